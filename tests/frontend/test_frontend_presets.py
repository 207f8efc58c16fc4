"""Scoring presets without a server: the Qwen3-Reranker preset renders exactly the published
token ids (the model card's construction: prefix ids + the pair's ids + suffix ids), labels are
checked at load, truncation is by tokens and refusals name the document; the settings the
frontend reads from the model's config.pbtxt are EngineConfig's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from prefillonly.contract.errors import ConfigError, InvalidRequestError
from prefillonly.contract.tokenizer_file import load_tokenizer
from prefillonly.frontend.app import ServedSettings
from prefillonly.frontend.presets import PRESETS_FILE, TemplateTokenizer, load_presets

REPO = Path(__file__).resolve().parents[2] / "model_repository"

# Qwen3-Reranker's model card, in its own pieces
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def published_qwen3_ids(tokenizer, query: str, doc: str, instruction: str | None = None) -> list[int]:
    pair = f"<Instruct>: {instruction or QWEN3_DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
    return (tokenizer.encode(QWEN3_PREFIX, add_special_tokens=False) + tokenizer.encode(pair, add_special_tokens=False)
            + tokenizer.encode(QWEN3_SUFFIX, add_special_tokens=False))


@pytest.fixture(scope="module")
def tokens(default_model_path):
    """The frontend's tokenizer (AutoTokenizer's ids: tests/frontend/test_tokenizer_file.py)."""
    return TemplateTokenizer(load_tokenizer(default_model_path), max_input_len=512)


@pytest.fixture(scope="module")
def presets(tokens):
    return load_presets(REPO / "prefillonly" / PRESETS_FILE, tokens)


def _random_text(rng: random.Random) -> str:
    words = ["Paris", "capital", " ", "  ", "\n", "été", "naïve", "42", "3.14", "<b>", "{query}", "{document}", "don't",
             "x", "!", "?", "--", "\t", "日本", "emoji 😀", "Document:", "<Query>", "yes", "no"]
    return "".join(rng.choice(words) + rng.choice(["", " ", "", "\n"]) for _ in range(rng.randint(0, 12)))


def test_qwen3_preset_is_the_published_token_ids(tokens, presets):
    preset = presets["qwen3-reranker"]
    assert preset.labels == ("yes", "no")
    rng = random.Random(0)
    cases = [("capital of France", "Paris is the capital."), ("q", ""), ("q ", " lead space"), ("", "doc"),
             ("query\n", "\nnewline doc"), ("a  b", "  two spaces")]
    cases += [(_random_text(rng), _random_text(rng)) for _ in range(200)]
    for query, doc in cases:
        for instruction in (None, "Find the answer"):
            rendered = tokens.render(preset, query, [doc], instruction=instruction)
            got = rendered.shared + rendered.items[0]
            assert got == published_qwen3_ids(tokens.tokenizer, query, doc, instruction), (query, doc)


def test_labels_must_be_single_tokens(tokens, tmp_path):
    path = tmp_path / PRESETS_FILE
    path.write_text(json.dumps({"judge": {"template": "{query}{document}", "labels": [" Yes", " xqzvbl"]}}))
    with pytest.raises(ConfigError, match=r"preset 'judge': label ' xqzvbl' is not one token"):
        load_presets(path, tokens)
    for bad, match in [({"template": "{document}{query}", "labels": ["a", "b"]}, "template must hold"),
                       ({"template": "{query}", "labels": ["a", "b"]}, "template must hold"),
                       ({"template": "{query}{document}", "labels": ["yes"]}, "at least two"),
                       ({"template": "{query}{document}", "labels": ["yes", "yes"]}, "not distinct"),
                       ({"template": "{query}{document}", "labels": ["yes", "no"], "color": 1}, "unknown field")]:
        path.write_text(json.dumps({"p": bad}))
        with pytest.raises(ConfigError, match=match):
            load_presets(path, tokens)


def test_truncation_by_tokens_and_refusal_by_index(tokens, presets):
    plain = presets["plain"]
    doc = " ".join(f"w{i}" for i in range(400))  # ~800 tokens: over the 512 of this tokenizer's test limit
    with pytest.raises(InvalidRequestError, match=r"documents\[1\] has \d+ tokens"):
        tokens.render(plain, "query", ["ok", doc])
    cut = tokens.render(plain, "query", ["ok", doc], max_tokens_per_doc=20)
    assert len(cut.items[1]) == 20 and cut.truncated == [1]
    assert cut.items[1] == tokens.encode(doc)[:20]
    right = tokens.render(plain, "query", [doc], truncate="right")
    left = tokens.render(plain, "query", [doc], truncate="left")
    room = tokens.max_input_len - len(right.shared)
    assert len(right.items[0]) == len(left.items[0]) == room
    assert right.items[0] == tokens.encode(doc)[:room] and left.items[0] == tokens.encode(doc)[-room:]
    with pytest.raises(InvalidRequestError, match="documents\\[0\\] is empty"):
        tokens.render(plain, "query", [""])
    with pytest.raises(InvalidRequestError, match="query is empty"):
        tokens.render(plain, "", ["doc"])


def test_braces_in_a_document_stay_text(tokens, presets):
    rendered = tokens.render(presets["plain"], "Q:", ["{query} {document} {instruction}"])
    qwen = tokens.render(presets["qwen3-reranker"], "{instruction}", ["d"], instruction="{query}")
    assert "<Instruct>: {query}\n<Query>: {instruction}\n" in tokens.tokenizer.decode(qwen.shared)
    assert tokens.tokenizer.decode(rendered.shared + rendered.items[0]) == "Q:{query} {document} {instruction}"


@pytest.mark.parametrize("changes", [{}, {"max_items": "12", "max_prompts_per_request": "none", "max_waiting": "5"},
                                     {"max_input_len": "1_000", "max_prompts_per_request": "7", "max_items": " 9 "},
                                     {"max_waiting": " 30 "}])
def test_served_settings_are_engine_configs(tmp_path, changes):
    """The frontend reads the engine model's settings without building EngineConfig (torch): the
    same values, defaults included, as the engine's config of the same config.pbtxt."""
    from prefillonly.config import EngineConfig
    from prefillonly.serving.host.model_settings import copy_model_repository, engine_settings

    model_dir = copy_model_repository(REPO, tmp_path / "repo", models=("prefillonly",), **changes) / "prefillonly"
    got, config = ServedSettings.read(model_dir), EngineConfig.from_strings(engine_settings(model_dir))
    assert (got.model, got.cache_dir, got.max_input_len, got.max_items, got.max_prompts) == (
        config.model, config.cache_dir, config.max_input_len, config.max_items, config.max_prompts_per_request)
