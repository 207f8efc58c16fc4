"""The two decision shapes, to and from the one question form (contract/decisions.py):

    POST /v1/decisions   OpenAI     {model, input (text or items), questions[], prompt_cache_key, ...}
                                    -> {id, object: "decision", model, answers[] in question order, usage}
    POST /v1/systemone   System One {model, state, questions{id: {type, instructions, criteria}}}
                                    -> {id, object: "systemone", model, answers{id: ...}, usage}

Both map to the same DecisionCall, so the same questions give the same numbers on either route.
OpenAI's input items: messages (user / developer / system / assistant; text parts, JSON parts as
compact JSON, an assistant's refusal parts as text) and function / custom tool calls and their
outputs as text ("Function call <name>(<arguments>)", "Function output: <output>"); an image
anywhere is refused (text only). System One: a `noul` is a predicate (criteria {"true": ..,
"false": ..} describe the two answers), a choice's criteria map each option to its description, a
score's criteria list the levels lowest first. Extensions on both: `debias: {"permutations": k}`
and `return_token_ids: true`.
"""

from __future__ import annotations

import json

from ..contract.decisions import (CHOICE, PREDICATE, SCORE, Answer, DecisionCall, DecisionError, DecisionResult,
                                  Message, Option, Question, summarize)

OPENAI_FIELDS = frozenset({"model", "input", "questions", "prompt_cache_key", "prompt_cache_options", "safety_identifier",
                           "debias", "return_token_ids", "user", "metadata", "store"})
SYSTEMONE_FIELDS = frozenset({"model", "state", "questions", "debias", "return_token_ids", "user"})
_SYSTEMONE_TYPES = {"noul": PREDICATE, "choice": CHOICE, "score": SCORE}


def _need(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise DecisionError(message, param)


# -- OpenAI ---------------------------------------------------------------------------------------
def openai_call(body: dict) -> DecisionCall:
    _need(isinstance(body, dict), "the body must be a JSON object", "body")
    _need("input" in body, "required", "input")
    _need(isinstance(body.get("questions"), list), "required: a list of questions", "questions")
    questions = tuple(_openai_question(q, f"questions[{i}]") for i, q in enumerate(body["questions"]))
    return _with_extensions(body, _openai_input(body["input"]), questions)


def _openai_input(value) -> tuple[Message, ...]:
    if isinstance(value, str):
        return (Message("user", value),)
    _need(isinstance(value, list) and value, "must be a text or a non-empty list of messages and tool items", "input")
    return tuple(_openai_item(item, f"input[{i}]") for i, item in enumerate(value))


def _openai_item(item, where: str) -> Message:
    _need(isinstance(item, dict), "must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        _need(item.get("role") in ("user", "developer", "system", "assistant"),
              "role must be user, developer, system or assistant", f"{where}.role")
        return Message(item["role"], _parts_text(item.get("content"), f"{where}.content"))
    if kind in ("function_call", "custom_tool_call"):
        arguments = item.get("arguments", item.get("input", ""))
        return Message("assistant", f"Function call {item.get('name', '')}({arguments})")
    if kind in ("function_call_output", "custom_tool_call_output"):
        return Message("user", "Function output: " + _parts_text(item.get("output"), f"{where}.output"))
    raise DecisionError(f"unknown input item type {kind!r}", f"{where}.type")


def _parts_text(content, where: str) -> str:
    """A content's text: a string, or parts (input_text / output_text / refusal as text, input_json
    as compact JSON); an image is refused."""
    if isinstance(content, str):
        return content
    _need(isinstance(content, list), "must be a text or a list of parts", where)
    texts = []
    for j, part in enumerate(content):
        _need(isinstance(part, dict), "must be an object", f"{where}[{j}]")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            _need(isinstance(part.get("text"), str), "must be a string", f"{where}[{j}].text")
            texts.append(part["text"])
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind == "input_json":
            texts.append(json.dumps(part.get("data"), ensure_ascii=False, separators=(",", ":")))
        elif kind in ("input_image", "image_url", "input_file"):
            raise DecisionError("text only: this server does not read images or files", f"{where}[{j}]")
        else:
            raise DecisionError(f"unknown part type {kind!r}", f"{where}[{j}].type")
    return "\n".join(texts)


def _openai_question(q, where: str) -> Question:
    _need(isinstance(q, dict), "must be an object", where)
    kind, name = q.get("type"), q.get("name")
    instructions = _parts_text(q.get("instructions", ""), f"{where}.instructions")
    if kind == PREDICATE:
        return Question(PREDICATE, instructions, (Option(True), Option(False)), name)
    if kind == CHOICE:
        options = _list(q, "choices", where)
        return Question(CHOICE, instructions, tuple(Option(o.get("value"), o.get("description")) if isinstance(o, dict)
                                                    else _bad(f"{where}.choices") for o in options), name)
    if kind == SCORE:
        levels = _list(q, "levels", where)
        return Question(SCORE, instructions, tuple(Option(o.get("label"), o.get("description")) if isinstance(o, dict)
                                                   else _bad(f"{where}.levels") for o in levels), name)
    raise DecisionError(f"unknown question type {kind!r}; use predicate, choice or score", f"{where}.type")


def openai_answer(question: Question, answer: Answer) -> dict:
    probs = answer.probabilities
    if question.type == PREDICATE:
        out = {"type": PREDICATE, "name": question.name, "probability": probs[0]}
    else:
        s = summarize(probs)
        if question.type == CHOICE:
            out = {"type": CHOICE, "name": question.name, "choice": question.options[s.best].value,
                   "probabilities": [{"value": o.value, "probability": p} for o, p in zip(question.options, probs)],
                   "confidence": s.confidence}
        else:
            out = {"type": SCORE, "name": question.name, "score": s.expected_level,
                   "probabilities": [{"value": i, "label": o.value, "probability": p}
                                     for i, (o, p) in enumerate(zip(question.options, probs))],
                   "confidence": s.confidence}
    return _token_ids(out, question, answer)


def _token_ids(out: dict, question: Question, answer: Answer) -> dict:
    """return_token_ids: the prompt up to the answer position, each option's answer tokens."""
    if answer.prompt_token_ids is None:
        return out
    out["prompt_token_ids"] = list(answer.prompt_token_ids)
    if question.type == PREDICATE:
        out["options"] = [{"value": v, "token_ids": list(ids)} for v, ids in zip((True, False), answer.option_token_ids)]
    else:
        for entry, ids in zip(out["probabilities"], answer.option_token_ids):
            entry["token_ids"] = list(ids)
    return out


def usage(result: DecisionResult) -> dict:
    """OpenAI's usage: the call's prompt tokens (the shared input once), of which cached; nothing
    is generated."""
    return {"input_tokens": result.input_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": result.input_tokens}


# -- System One -----------------------------------------------------------------------------------
def systemone_call(body: dict) -> tuple[DecisionCall, list[str]]:
    """The call, and the question ids in the order asked."""
    _need(isinstance(body, dict), "the body must be a JSON object", "body")
    _need("state" in body, "required", "state")
    state = body["state"]
    text = state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)
    questions = body.get("questions")
    _need(isinstance(questions, dict), "required: an object of questions keyed by id", "questions")
    ids = list(questions)
    converted = tuple(_systemone_question(questions[i], f"questions.{i}") for i in ids)
    return _with_extensions(body, (Message("user", text),), converted), ids


def _systemone_question(q, where: str) -> Question:
    _need(isinstance(q, dict), "must be an object", where)
    kind = _SYSTEMONE_TYPES.get(q.get("type"))
    _need(kind is not None, f"unknown question type {q.get('type')!r}; use noul, choice or score", f"{where}.type")
    raw = q.get("instructions", "")
    instructions = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)
    criteria = q.get("criteria")
    if kind == PREDICATE:
        c = criteria or {}
        _need(isinstance(c, dict), "a noul's criteria are {\"true\": ..., \"false\": ...}", f"{where}.criteria")
        return Question(PREDICATE, instructions, (Option(True, c.get("true")), Option(False, c.get("false"))))
    if kind == CHOICE:
        _need(isinstance(criteria, dict), "a choice's criteria map each option to its description", f"{where}.criteria")
        return Question(CHOICE, instructions, tuple(Option(k, v) for k, v in criteria.items()))
    _need(isinstance(criteria, list), "a score's criteria list the levels, lowest first", f"{where}.criteria")
    return Question(SCORE, instructions, tuple(Option(v if isinstance(v, str) else json.dumps(v)) for v in criteria))


def systemone_answer(question: Question, answer: Answer) -> dict:
    probs = answer.probabilities
    if question.type == PREDICATE:
        out = {"type": "noul", "noul": probs[0]}
    else:
        s = summarize(probs)
        if question.type == CHOICE:
            out = {"type": CHOICE, "choice": question.options[s.best].value,
                   "probabilities": {o.value: p for o, p in zip(question.options, probs)}, "confidence": s.confidence}
        else:
            out = {"type": SCORE, "score": s.expected_level, "legend": {str(i): o.value for i, o in enumerate(question.options)},
                   "probabilities": {str(i): p for i, p in enumerate(probs)}, "confidence": s.confidence}
    if answer.prompt_token_ids is not None:
        out["prompt_token_ids"] = list(answer.prompt_token_ids)
        out["option_token_ids"] = [list(x) for x in answer.option_token_ids]
    return out


# -- shared ---------------------------------------------------------------------------------------
def _with_extensions(body: dict, messages: tuple[Message, ...], questions: tuple[Question, ...]) -> DecisionCall:
    debias = body.get("debias") or {}
    _need(isinstance(debias, dict), "must be an object such as {\"permutations\": 4}", "debias")
    permutations = debias.get("permutations", 1)
    _need(isinstance(permutations, int) and not isinstance(permutations, bool), "must be a whole number",
          "debias.permutations")
    return_ids = body.get("return_token_ids", False)
    _need(isinstance(return_ids, bool), "must be true or false", "return_token_ids")
    call = DecisionCall(messages, questions, permutations, return_ids)
    call.check()
    return call


def _list(q: dict, key: str, where: str) -> list:
    value = q.get(key)
    _need(isinstance(value, list), f"required: a list of {key}", f"{where}.{key}")
    return value


def _bad(where: str):
    raise DecisionError("must be an object", where)
