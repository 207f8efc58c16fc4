"""The frontend's tokenizer (contract/tokenizer_file.py: tokenizer.json run by the `tokenizers`
library) against transformers' AutoTokenizer, which the engine tokenizes with: on the default
model the whole pipeline, the ids of fresh random texts and of every preset's rendering, and every
token's text are the same; so are they under the tokenizer_config.json settings transformers
applies on top of the file; a tokenizer whose class transformers rebuilds is refused by name;
the context length is ModelSpec's without transformers; and the frontend builds without torch."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefillonly.contract.errors import ConfigError, InvalidRequestError
from prefillonly.contract.tokenizer_file import KNOWN_MODEL_TYPES, load_tokenizer
from prefillonly.frontend.presets import PRESETS_FILE, TemplateTokenizer, load_presets
from prefillonly.contract.checkpoint import context_length_of
from prefillonly.model.spec import ModelSpec

from ..conftest import FAMILY_CONFIGS

REPO = Path(__file__).resolve().parents[2] / "model_repository"
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
# pieces of the random texts: words, every kind of space, accents (composed and combining),
# ligatures, other scripts, emoji (with joiners), digits, markup and the model's special tokens
PIECES = ["the", "Paris", "capital", "don't", "I'm", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u200b",
          "\u3000", "été", "e\u0301te\u0301", "naïve", "Straße", "ﬁne", "Ω≈ç√", "日本語", "中文", "한국어", "العربية", "١٢٣",
          "Ελληνικά", "русский", "😀", "👩\u200d👩\u200d👧", "🇫🇷", "0", "42", "3.14159", "1,000,000", "...", "?!", "--", "<b>",
          "</b>", "{query}", "```", "\\n", "http://x.y/z?a=1", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>"]


def _random_text(rng: random.Random) -> str:
    """Pieces and random code points (no surrogates), in runs of odd lengths, sometimes long."""
    out = []
    for _ in range(rng.choice([0, 1, 2, 3, 7, 13, 40, 301])):
        if rng.random() < 0.25:
            out.append(chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF), rng.randint(0x3000, 0xD7FF),
                                       rng.randint(0xE000, 0xFFFD), rng.randint(0x1F300, 0x1FAFF)])))
        else:
            out.append(rng.choice(PIECES) + rng.choice(["", "", " ", "\n"]))
    return "".join(out)


def _pipeline(backend) -> dict:
    """A tokenizers.Tokenizer as JSON, less truncation and padding (transformers turns them off per call)."""
    data = json.loads(backend.to_str())
    data.pop("truncation", None)
    data.pop("padding", None)
    return data


@pytest.fixture(scope="module")
def auto(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


@pytest.fixture(scope="module")
def ours(default_model_path):
    return load_tokenizer(default_model_path)


def test_default_model_pipeline_is_autotokenizers(auto, ours):
    assert type(auto).__name__ == "TokenizersBackend"
    assert _pipeline(ours.backend) == _pipeline(auto.backend_tokenizer)
    assert ours.eos_token_id == auto.eos_token_id is not None


def test_ids_of_fresh_random_texts(auto, ours):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    texts = [_random_text(rng) for _ in range(400)] + ["", " ", "\n", "<|im_start|>", " <|im_end|> "]
    for special in (True, False):
        for text in texts:
            assert ours.encode(text, add_special_tokens=special) == auto.encode(text, add_special_tokens=special), \
                (seed, text, special)
        batch = ours(texts, add_special_tokens=special)["input_ids"]
        assert batch == auto(texts, add_special_tokens=special)["input_ids"], seed


def _outcome(call, *args, **kwargs):
    """What a call returns, or the refusal it raises (an empty document is refused by both)."""
    try:
        return call(*args, **kwargs)
    except InvalidRequestError as e:
        return str(e)


def test_every_preset_renders_the_same_ids(auto, ours):
    theirs, mine = TemplateTokenizer(auto, 8192), TemplateTokenizer(ours, 8192)
    presets = load_presets(REPO / "prefillonly" / PRESETS_FILE, mine)
    assert presets == load_presets(REPO / "prefillonly" / PRESETS_FILE, theirs)  # the labels' ids too
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for preset in presets.values():
        for _ in range(60):
            query, docs = _random_text(rng) or "q", [_random_text(rng) for _ in range(rng.randint(1, 4))]
            instruction = rng.choice([None, "", _random_text(rng)])
            assert _outcome(mine.render, preset, query, docs, instruction=instruction) == \
                _outcome(theirs.render, preset, query, docs, instruction=instruction), (seed, preset.name, query, docs)
            assert mine.split_joined(query, docs) == theirs.split_joined(query, docs), (seed, query, docs)


def test_every_token_text(auto, ours):
    size = auto.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    assert size == ours.backend.get_vocab_size(with_added_tokens=True) > 49_000
    mine = [ours.decode([i], clean_up_tokenization_spaces=False) for i in range(size)]
    assert mine == [auto.decode([i], clean_up_tokenization_spaces=False) for i in range(size)]


# tokenizer_config.json / tokenizer.json settings transformers applies on top of the file (or drops)
_PAD = {"content": "<PAD>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
_BOS_FIRST = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                                       {"Sequence": {"id": "A", "type_id": 0}}],
              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
VARIANTS = {
    # transformers 5 drops these when a tokenizer.json exists: the file's post-processor decides
    "add_bos_and_eos_token": ({"add_bos_token": True, "add_eos_token": True, "eos_token": "<|im_end|>"}, {}, {}),
    "a_bos_post_processor": ({}, {"post_processor": _BOS_FIRST}, {}),
    "no_post_processor": ({}, {"post_processor": None}, {}),
    "named_tokens_the_file_lacks": ({"pad_token": "<PAD>", "image_token": "<img>", "extra_special_tokens": ["<x1>"],
                                     "eos_token": "<|im_end|>"}, {}, {}),
    "additional_special_tokens": ({"additional_special_tokens": ["<x1>", "<|im_end|>"]}, {}, {}),
    "a_saved_added_token": ({"pad_token": {"__type": "AddedToken", **_PAD, "lstrip": True}}, {}, {}),
    "added_tokens_decoder_flags": ({"added_tokens_decoder": {"2": {**_PAD, "content": "<|im_end|>", "lstrip": True,
                                                                   "rstrip": True, "special": True}}}, {}, {}),
    "special_tokens_map": ({}, {}, {"special_tokens_map.json": {"pad_token": _PAD, "additional_special_tokens": ["<x1>"]}}),
    "split_special_tokens": ({"split_special_tokens": True}, {}, {}),
    "truncation_in_the_file": ({}, {"truncation": {"direction": "Right", "max_length": 3, "strategy": "LongestFirst",
                                                   "stride": 0}}, {}),
}


def _variant(source: str, folder: Path, settings: dict, file: dict, extra: dict) -> Path:
    folder.mkdir()
    for name in FILES:
        shutil.copy(Path(source) / name, folder)
    for name, changes in (("tokenizer_config.json", settings), ("tokenizer.json", file)):
        data = json.loads((folder / name).read_text())
        data.update(changes)
        (folder / name).write_text(json.dumps(data))
    for name, data in extra.items():
        (folder / name).write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tokenizer_settings_as_transformers_applies_them(default_model_path, tmp_path, name):
    from transformers import AutoTokenizer

    folder = _variant(default_model_path, tmp_path / name, *VARIANTS[name])
    auto, ours = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    assert _pipeline(ours.backend) == _pipeline(auto.backend_tokenizer)
    assert ours.eos_token_id == auto.eos_token_id
    rng = random.Random(name)
    texts = [_random_text(rng) for _ in range(40)] + ["<PAD> <x1><img><|im_end|> x", "a b c d e"]
    for special in (True, False):
        assert ours(texts, add_special_tokens=special)["input_ids"] == auto(texts, add_special_tokens=special)["input_ids"]
        assert [ours.encode(t, add_special_tokens=special) for t in texts] == \
            [auto.encode(t, add_special_tokens=special) for t in texts]


@pytest.fixture(scope="module")
def small_tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json of a few hundred tokens: loads in milliseconds, in every class."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the capital of France is Paris", "naïve café, 42 times"] * 20, trainer)
    path = tmp_path_factory.mktemp("small_tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def _small_checkpoint(folder: Path, tokenizer_file: Path, model_type: str, tokenizer_class: str | None,
                      **settings) -> Path:
    folder.mkdir()
    shutil.copy(tokenizer_file, folder)
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", **settings}
    if tokenizer_class:
        config["tokenizer_class"] = tokenizer_class
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


@pytest.mark.parametrize("model_type", KNOWN_MODEL_TYPES)
def test_only_tokenizers_that_transformers_runs_as_written_are_taken(small_tokenizer_file, tmp_path, model_type):
    """Taken <=> AutoTokenizer loads it as TokenizersBackend (tokenizer.json as written), for each
    class a checkpoint may name (none named: refused even where transformers runs the file)."""
    from transformers import AutoTokenizer

    for name in ("TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2Tokenizer",
                 "GemmaTokenizerFast", "GPT2Tokenizer", None):
        folder = _small_checkpoint(tmp_path / str(name), small_tokenizer_file, model_type, name)
        as_written = type(AutoTokenizer.from_pretrained(folder)).__name__ == "TokenizersBackend"
        try:
            ours = load_tokenizer(folder)
        except ConfigError as e:
            assert str(folder / ("tokenizer_config.json" if name else "config.json")) in str(e)
            assert not as_written or name is None, (model_type, name)
            continue
        assert as_written, (model_type, name)
        assert _pipeline(ours.backend) == _pipeline(AutoTokenizer.from_pretrained(folder).backend_tokenizer)


def test_refusals_name_the_file(small_tokenizer_file, default_model_path, tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}.* has no tokenizer.json"):
        load_tokenizer(tmp_path)
    custom = _small_checkpoint(tmp_path / "custom", small_tokenizer_file, "llama", "TokenizersBackend",
                               auto_map={"AutoTokenizer": [None, "tok.MyTokenizer"]})
    with pytest.raises(ConfigError, match=f"{custom}/tokenizer_config.json: .*code of its own"):
        load_tokenizer(custom)
    other = _small_checkpoint(tmp_path / "other", small_tokenizer_file, "gpt2", "TokenizersBackend")
    with pytest.raises(ConfigError, match=f"{other}/config.json: model_type 'gpt2'"):
        load_tokenizer(other)
    broken = _small_checkpoint(tmp_path / "broken", small_tokenizer_file, "llama", "TokenizersBackend")
    (broken / "tokenizer.json").write_text('{"model": {}}')
    with pytest.raises(ConfigError, match=f"cannot read the tokenizer {broken}/tokenizer.json"):
        load_tokenizer(broken)
    legacy = _small_checkpoint(tmp_path / "legacy", small_tokenizer_file, "llama", "TokenizersBackend")
    (legacy / "added_tokens.json").write_text('{"<new>": 400}')
    with pytest.raises(ConfigError, match=f"{legacy}/added_tokens.json"):
        load_tokenizer(legacy)


# family -> its architecture, for config.json files written from FAMILY_CONFIGS without a model
ARCHITECTURES = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM", "Qwen2Config": "Qwen2ForCausalLM",
                 "Qwen3Config": "Qwen3ForCausalLM", "Gemma2Config": "Gemma2ForCausalLM",
                 "Gemma3TextConfig": "Gemma3ForCausalLM", "Phi3Config": "Phi3ForCausalLM"}
# (config class, kwargs, keys to delete from the written config.json): windows that bound the
# context length or do not, and windows left to the config class's default
WINDOWS = {
    "mistral_window_under_positions": ("MistralConfig", {"sliding_window": 512}, ()),
    "mistral_window_left_out": ("MistralConfig", {"max_position_embeddings": 8192}, ("sliding_window",)),
    "qwen2_window_used": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 100}, ()),
    "qwen2_window_left_out": ("Qwen2Config", {"use_sliding_window": True, "max_position_embeddings": 8192},
                              ("sliding_window",)),
    "qwen3_window_unused": ("Qwen3Config", {"use_sliding_window": False, "sliding_window": 100}, ()),
    "llama_with_a_window": ("LlamaConfig", {"sliding_window": 100}, ()),
}


def _config_folder(folder: Path, cls_name: str, kwargs: dict, drop=()) -> Path:
    import transformers

    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [ARCHITECTURES[cls_name]]
    config.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    for key in drop:
        data.pop(key, None)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS) + sorted(WINDOWS))
def test_context_length_without_transformers_is_model_specs(tmp_path, name):
    cls_name, kwargs, drop = WINDOWS[name] if name in WINDOWS else (*FAMILY_CONFIGS[name], ())
    folder = _config_folder(tmp_path, cls_name, dict(kwargs), drop)
    assert context_length_of(str(folder)) == ModelSpec.from_folder(str(folder)).context_length


def test_context_length_refusals(tmp_path):
    folder = _config_folder(tmp_path, "LlamaConfig", {}, ("max_position_embeddings",))
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        context_length_of(str(folder))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unsupported model architecture"):
        context_length_of(str(tmp_path))


def test_the_frontend_builds_without_torch_or_transformers(default_model_path):
    """build_scoring on the repository's model_repository, in a fresh interpreter (it needs no
    running Triton): the tokenizer, the context length and the presets load, and neither torch
    nor transformers is imported."""
    script = ("import sys\n"
              "from prefillonly.frontend.app import build_scoring\n"
              f"scoring = build_scoring({str(REPO)!r}, '127.0.0.1:1')\n"
              "assert sorted(scoring.presets) == ['plain', 'qwen3-reranker', 'yes-no-judge'], scoring.presets\n"
              "assert scoring.tokens.max_input_len == 8192 and scoring.eos_id is not None\n"
              "loaded = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
              "sys.exit(f'build_scoring loaded {loaded}' if loaded else 0)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_frontend_falls_back_to_autotokenizer_where_the_file_alone_would_differ(small_tokenizer_file, default_model_path,
                                                                                  tmp_path):
    """A checkpoint whose tokenizer transformers rebuilds from its own class (Qwen's) is not refused
    at start: the frontend loads AutoTokenizer for it (ids equal by construction); the default
    model keeps the file tokenizer (no torch)."""
    from transformers import AutoTokenizer

    from prefillonly.contract.tokenizer_file import FileTokenizer, NotAsWritten
    from prefillonly.frontend.app import _tokenizer

    rebuilt = _small_checkpoint(tmp_path / "qwen", small_tokenizer_file, "qwen2", "Qwen2Tokenizer")
    with pytest.raises(NotAsWritten):
        load_tokenizer(rebuilt)
    tok = _tokenizer(rebuilt)
    assert not isinstance(tok, FileTokenizer)
    text = "Hello wörld, 1234 and  spaces\n\ttabs"
    assert tok.encode(text) == AutoTokenizer.from_pretrained(rebuilt).encode(text)
    assert isinstance(_tokenizer(default_model_path), FileTokenizer)
