"""Embeddings and sequence classifiers / reward models equal transformers' float32 on the same
weights (AutoModel + the checkpoint's sentence-transformers pooling; AutoModelForSequenceClassification)
within 1e-4, cold and over a cached prefix (the cached positions' hidden states read from the
prefix cache), and the pooled requests' options and refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from prefillonly import Engine, EngineConfig
from prefillonly.contract.errors import InvalidRequestError, PromptTooLongError

from ..conftest import _TOKENIZER_FILES, FAMILY_CONFIGS, SAME_KERNELS, make_random_model

TOL = 1e-4
LENGTHS = (1, 19, 130)  # one token; odd, a cache block and a few tokens; over the 64-row chunk
BLOCK = 16

# name -> (family config, sentence-transformers pooling mode or None (a classifier), Normalize module)
EMBEDDERS = {
    "qwen3_last_normalized": ("qwen3_qknorm_untied", "lasttoken", True),
    "llama_mean": ("llama_gqa_llama3rope_untied", "mean_tokens", False),
    "gemma3_first_token": ("gemma3_window_two_ropes", "cls_token", True),
}
# name -> (family config, num_labels, problem_type)
CLASSIFIERS = {
    "qwen2_reward": ("qwen2_bias_tied", 1, None),
    "llama_three_labels": ("llama_mha_tied", 3, None),
    "gemma2_multi_label": ("gemma2_softcap_window", 3, "multi_label_classification"),
}


def _eager(family: str) -> dict:
    """Gemma's soft-capping and windows are exact in transformers' eager attention only."""
    return {"attn_implementation": "eager"} if family.startswith("gemma") else {}


def write_st_pooling(folder, mode: str, normalize: bool, prompts: dict | None = None, default_prompt: str | None = None):
    """The sentence-transformers files of a pooled checkpoint: modules.json, 1_Pooling/config.json
    and (with prompts) config_sentence_transformers.json."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({f"pooling_mode_{mode}": True, "include_prompt": True}, f)
    if prompts is not None:
        with open(os.path.join(folder, "config_sentence_transformers.json"), "w") as f:
            json.dump({"prompts": prompts, "default_prompt_name": default_prompt}, f)


def st_pool(hidden: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    """sentence-transformers' pooling of one unpadded sequence's last_hidden_state [S, d]."""
    vector = {"lasttoken": hidden[-1], "mean_tokens": hidden.mean(0), "cls_token": hidden[0]}[mode]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def _engine(folder: str, **overrides) -> Engine:
    return Engine(EngineConfig(model=folder, dtype="float32", threads=1, cache_block_size=BLOCK, **SAME_KERNELS, **overrides))


@pytest.fixture(scope="module", params=list(EMBEDDERS))
def embedder(request, tmp_path_factory):
    family, mode, normalize = EMBEDDERS[request.param]
    model = make_random_model(*FAMILY_CONFIGS[family], auto="AutoModel", **_eager(family))
    model.config.architectures = [type(model).__name__]  # saved bare: tensors without the "model." prefix
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    write_st_pooling(folder, mode, normalize)
    with _engine(str(folder)) as engine:
        yield engine, model, mode, normalize


@pytest.fixture(scope="module", params=list(CLASSIFIERS))
def classifier(request, tmp_path_factory):
    family, labels, problem = CLASSIFIERS[request.param]
    cls_name, kwargs = FAMILY_CONFIGS[family]
    kwargs = dict(kwargs, num_labels=labels, problem_type=problem, id2label={i: f"label-{i}" for i in range(labels)})
    model = make_random_model(cls_name, kwargs, auto="AutoModelForSequenceClassification", **_eager(family))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    with _engine(str(folder)) as engine:
        yield engine, model


def _ids(n: int, seed: int, vocab: int = 300) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _hidden(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), use_cache=False).last_hidden_state[0]


@pytest.mark.parametrize("n", LENGTHS)
def test_embedding_equals_sentence_transformers_pooling_cold_and_over_a_cached_prefix(embedder, n):
    engine, model, mode, normalize = embedder
    ids = _ids(n, seed=n)
    want = st_pool(_hidden(model, ids), mode, normalize)
    cold = engine.embed(ids, cache_namespace=f"cold-{n}")
    assert cold.cached_tokens == 0 and cold.normalized == normalize and cold.prompt_tokens == n
    assert float((torch.tensor(cold.embedding) - want).abs().max()) <= TOL
    if n > 1:  # a first request leaves its whole blocks; the second reads them (and their hidden states)
        engine.embed(ids[: n - 3] + _ids(3, seed=99), cache_namespace=f"warm-{n}")
        warm = engine.embed(ids, cache_namespace=f"warm-{n}")
        assert warm.cached_tokens >= BLOCK
        assert float((torch.tensor(warm.embedding) - want).abs().max()) <= TOL


def test_embedding_matryoshka_truncates_then_normalises(embedder):
    engine, model, mode, _ = embedder
    ids = _ids(23, seed=5)
    full = st_pool(_hidden(model, ids), mode, False)
    short = engine.embed(ids, dimensions=8, normalize=True)
    assert len(short.embedding) == 8 and short.normalized
    assert float((torch.tensor(short.embedding) - torch.nn.functional.normalize(full[:8], dim=0)).abs().max()) <= TOL
    raw = engine.embed(ids, dimensions=8, normalize=False)
    assert float((torch.tensor(raw.embedding) - full[:8]).abs().max()) <= TOL


def test_a_list_of_prompts_embeds_each_in_order(embedder):
    engine, model, mode, normalize = embedder
    prompts = [_ids(n, seed=40 + n) for n in (9, 31, 2)]
    out = engine.embed(prompts)
    for ids, result in zip(prompts, out):
        assert float((torch.tensor(result.embedding) - st_pool(_hidden(model, ids), mode, normalize)).abs().max()) <= TOL


@pytest.mark.parametrize("n", LENGTHS)
def test_classifier_scores_equal_transformers_cold_and_over_a_cached_prefix(classifier, n):
    engine, model = classifier
    ids = _ids(n, seed=7 * n)
    with torch.inference_mode():
        want = model(torch.tensor([ids]), use_cache=False).logits[0]
    cold = engine.classify(ids, cache_namespace=f"cold-{n}")
    assert float((torch.tensor(cold.logits) - want).abs().max()) <= TOL
    config = model.config
    assert cold.labels == [config.id2label[i] for i in range(config.num_labels)]
    assert cold.label == cold.labels[int(want.argmax())]
    expected = {"multi_label_classification": want.sigmoid(), None: want.softmax(-1) if config.num_labels > 1 else want}
    assert float((torch.tensor(cold.probs) - expected[config.problem_type]).abs().max()) <= TOL
    if n > 1:
        engine.classify(ids[: n - 2] + _ids(2, seed=3), cache_namespace=f"warm-{n}")
        warm = engine.classify(ids, cache_namespace=f"warm-{n}")
        assert warm.cached_tokens >= BLOCK
        assert float((torch.tensor(warm.logits) - want).abs().max()) <= TOL


def test_best_of_n_scores_each_response_after_the_prompt_computed_once(classifier):
    engine, model = classifier
    prompt = _ids(45, seed=11)
    responses = [_ids(n, seed=20 + n) for n in (1, 6, 19, 6)]
    before = engine.executor.tokens_computed
    out = engine.classify(prompt, responses, cache_namespace="best-of-n")
    # the prompt once, then each response: nothing computed twice
    assert engine.executor.tokens_computed - before == len(prompt) + sum(map(len, responses))
    assert len(out) == len(responses)
    for response, result in zip(responses, out):
        with torch.inference_mode():
            want = model(torch.tensor([prompt + response]), use_cache=False).logits[0]
        assert result.prompt_tokens == len(prompt) + len(response)
        assert float((torch.tensor(result.logits) - want).abs().max()) <= TOL


def test_a_causal_lm_embeds_its_last_token_normalised_without_sentence_transformers_files(family_folders):
    from ..reference import load_hf

    folder = family_folders["qwen2_bias_tied"]
    model = load_hf(folder, torch.float32)
    ids = _ids(29, seed=2)
    with _engine(folder) as engine:
        out = engine.embed(ids)
        with pytest.raises(InvalidRequestError, match="sequence classifier.*causal LM"):
            engine.classify(ids)
    want = torch.nn.functional.normalize(_hidden(model.model, ids)[-1], dim=0)
    assert out.pooling == "last" and out.normalized
    assert float((torch.tensor(out.embedding) - want).abs().max()) <= TOL


def test_a_checkpoint_answers_only_the_tasks_its_head_can(embedder, classifier):
    embed_engine, classify_engine = embedder[0], classifier[0]
    with pytest.raises(InvalidRequestError, match="task 'score' needs a causal LM; the served checkpoint is an embedding model"):
        embed_engine.score(_ids(4, 1), [5])
    with pytest.raises(InvalidRequestError, match="task 'classify' needs a sequence classifier"):
        embed_engine.classify(_ids(4, 1))
    with pytest.raises(InvalidRequestError, match="task 'embed' needs .*the served checkpoint is a sequence classifier"):
        classify_engine.embed(_ids(4, 1))
    with pytest.raises(InvalidRequestError, match="task 'loglikelihood' needs a causal LM"):
        classify_engine.loglikelihood(_ids(4, 1), [[5]])


# -- text prompts: named prompts, truncation, bad options ------------------------------------------
@pytest.fixture(scope="module")
def text_embedder(tmp_path_factory, default_model_path):
    """A bare Llama with the default model's tokenizer, a 64-token context and named prompts."""
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=49152, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True)
    model = make_random_model("LlamaConfig", config, auto="AutoModel")
    model.config.architectures = ["LlamaModel"]
    folder = tmp_path_factory.mktemp("text_embedder")
    model.save_pretrained(folder)
    for name in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(default_model_path, name)):
            shutil.copy(os.path.join(default_model_path, name), folder)
    write_st_pooling(folder, "lasttoken", True, {"query": "Instruct: find the passage\nQuery: ", "document": ""}, "document")
    from transformers import AutoTokenizer

    with _engine(str(folder)) as engine:
        yield engine, model, AutoTokenizer.from_pretrained(folder)


def test_named_prompt_is_put_before_the_text_as_sentence_transformers_does(text_embedder):
    engine, model, tokenizer = text_embedder
    text = "how do tides work?"
    for name, prefix in (("query", "Instruct: find the passage\nQuery: "), (None, "")):  # None: the default, "document"
        want = st_pool(_hidden(model, tokenizer(prefix + text)["input_ids"]), "lasttoken", True)
        got = engine.embed(text, prompt_name=name)
        assert float((torch.tensor(got.embedding) - want).abs().max()) <= TOL


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncate_cuts_a_long_prompt_from_its_side(text_embedder, side):
    engine, model, tokenizer = text_embedder
    ids = _ids(90, seed=8, vocab=49152)
    with pytest.raises(PromptTooLongError):
        engine.embed(ids)
    got = engine.embed(ids, truncate=side)
    kept = ids[:64] if side == "right" else ids[-64:]
    assert got.truncated_tokens == 26 and got.prompt_tokens == 64
    assert float((torch.tensor(got.embedding) - st_pool(_hidden(model, kept), "lasttoken", True)).abs().max()) <= TOL


def test_truncation_keeps_leading_and_trailing_special_tokens():
    from prefillonly.tasks.pooled import cut_tokens

    bos, eos = 1, 2
    ids = [bos, 10, 11, 12, 13, 14, eos]
    assert cut_tokens(ids, 5, "right", {bos, eos}) == [bos, 10, 11, 12, eos]
    assert cut_tokens(ids, 5, "left", {bos, eos}) == [bos, 12, 13, 14, eos]
    assert cut_tokens(ids, 2, "right", {bos, eos}) == [bos, 10]  # no room for the text between them: a plain cut
    assert cut_tokens([10, 11, 12], 2, "left", set()) == [11, 12]


@pytest.mark.parametrize("kwargs, message", [
    (dict(dimensions=0), "dimensions 0 must be between 1 and the model's hidden size 64"),
    (dict(dimensions=65), "dimensions 65 must be between 1"),
    (dict(dimensions="8"), "dimensions must be an integer"),
    (dict(prompt_name="passage"), "prompt_name 'passage' is not one of this model's prompts: query, document"),
    (dict(normalize="yes"), "normalize must be true or false"),
    (dict(truncate="middle"), "truncate must be one of right, left"),
])
def test_bad_embedding_options_are_refused_naming_the_field(text_embedder, kwargs, message):
    engine = text_embedder[0]
    with pytest.raises(InvalidRequestError, match=message):
        engine.embed("a text", **kwargs)
    assert len(engine.embed("still serving").embedding) == 64


def test_bad_embedding_inputs_are_refused(text_embedder):
    engine = text_embedder[0]
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.embed("")
    with pytest.raises(InvalidRequestError, match="prompt_name applies to text input"):
        engine.embed([5, 6, 7], prompt_name="query")
    with pytest.raises(InvalidRequestError, match="input is not valid UTF-8: byte 0xff"):  # decoded before the prompt goes before it
        engine.embed(b"\xff\xfe", prompt_name="query")
