"""The served model's tokenizer without transformers, so without torch: the scoring frontend
tokenizes every request, and loading transformers' AutoTokenizer would import torch (seconds and
hundreds of MB per process) for what the `tokenizers` library does alone from tokenizer.json.

It must give AutoTokenizer's ids and token texts (the engine's), so it does what transformers 5
(the pinned version) does on top of tokenizer.json, read in its source:

- the class: AutoTokenizer runs tokenizer.json as written only when it picks TokenizersBackend
  (tokenizer_class TokenizersBackend or PreTrainedTokenizerFast, or any class for a Mistral or
  Phi-3 config). A model-specific class (Qwen2Tokenizer, LlamaTokenizer, GemmaTokenizer, ...)
  keeps the file's vocabulary, merges and post-processor but rebuilds the normalizer,
  pre-tokenizer and decoder from its own code, so the ids can differ from the file's: refused,
  naming the file (NotAsWritten, a ConfigError), as is a tokenizer with code of its own (auto_map);
  the frontend then loads transformers' AutoTokenizer for that checkpoint instead (and so torch).
- BOS / EOS: tokenizer_config.json's add_bos_token / add_eos_token are dropped when there is a
  tokenizer.json (tokenization_utils_base._from_pretrained): the file's post-processor decides.
- special tokens named in tokenizer_config.json (or special_tokens_map.json) are added as
  transformers adds them, so a named token the file lacks is still one token;
  split_special_tokens is honoured.
- the file's truncation and padding are off (transformers turns them off for a call that asks for
  neither); decode is the file's decoder, as decode(ids, clean_up_tokenization_spaces=False) is.

tests/frontend/test_tokenizer_file.py compares the whole pipeline and the ids with AutoTokenizer's.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from .errors import ConfigError

TOKENIZER_FILE, CONFIG_FILE, MODEL_CONFIG = "tokenizer.json", "tokenizer_config.json", "config.json"
SPECIAL_TOKENS_MAP, ADDED_TOKENS_FILE = "special_tokens_map.json", "added_tokens.json"
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# classes that AutoTokenizer loads as TokenizersBackend: tokenizer.json as written
AS_WRITTEN = ("TokenizersBackend", "PreTrainedTokenizerFast")
# model types whose tokenizer AutoTokenizer loads as TokenizersBackend whatever class the files name
# (no class of their own; Mistral's is mistral-common's where that package and tekken.json are: refused)
BACKEND_MODEL_TYPES = ("mistral", "phi3")
# model types of the supported families: for any other, which class AutoTokenizer picks is not known here
KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "phi3")
# model types whose own class AutoTokenizer uses even when the files name an AS_WRITTEN class
OWN_CLASS_MODEL_TYPES = ("qwen2",)


class NotAsWritten(ConfigError):
    """tokenizer.json alone would not give transformers' ids for this checkpoint (no such file, a
    class transformers rebuilds, code of its own, ...): the frontend then loads AutoTokenizer."""


class FileTokenizer:
    """What the frontend asks of a tokenizer, with transformers' signatures: encode(text,
    add_special_tokens), a batch call giving {"input_ids": [...]}, decode(ids,
    clean_up_tokenization_spaces) and eos_token_id."""

    def __init__(self, backend, eos_token_id: int | None):
        self.backend = backend  # a tokenizers.Tokenizer
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        return {"input_ids": [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]}

    def decode(self, ids: list[int], clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:  # transformers skips it for BPE anyway; the frontend never asks
            raise ValueError("clean_up_tokenization_spaces is not supported: token texts are reported as decoded")
        return self.backend.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(folder: str | Path) -> FileTokenizer:
    """The tokenizer of checkpoint `folder`, as AutoTokenizer.from_pretrained(folder) would give it;
    ConfigError naming the folder or file when there is none, or one whose ids could differ."""
    from tokenizers import Tokenizer

    folder = Path(folder)
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise NotAsWritten(f"the model folder {folder} has no {TOKENIZER_FILE}: the scoring frontend tokenizes with "
                          "it (a tokenizer of sentencepiece or vocab files only is not read)")
    settings = _read_json(folder / CONFIG_FILE)
    _check_class(folder, settings, _read_json(folder / MODEL_CONFIG))
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust parser's errors carry no common type
        raise ConfigError(f"cannot read the tokenizer {path}: {e}") from e
    backend.no_truncation()
    backend.no_padding()
    if backend.post_processor is None:  # TokenizersBackend.update_post_processor, BOS and EOS off
        from tokenizers.processors import TemplateProcessing

        backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    special = _special_tokens(folder, settings, backend)
    _add_special_tokens(backend, special)
    backend.encode_special_tokens = bool(settings.get("split_special_tokens", False))
    return FileTokenizer(backend, _token_id(backend, special["named"].get("eos_token"), special["named"].get("unk_token")))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _check_class(folder: Path, settings: dict, model_config: dict) -> None:
    """ConfigError unless AutoTokenizer would run tokenizer.json as written (the module's docstring)."""
    if settings.get("auto_map"):
        raise NotAsWritten(f"{folder / CONFIG_FILE}: the tokenizer has code of its own (auto_map); the scoring frontend "
                          f"runs {TOKENIZER_FILE} alone and cannot promise its ids")
    model_type = model_config.get("model_type")
    named = settings.get("tokenizer_class") or model_config.get("tokenizer_class")
    source = folder / (CONFIG_FILE if settings.get("tokenizer_class") else MODEL_CONFIG)
    if model_type not in KNOWN_MODEL_TYPES:
        raise NotAsWritten(f"{folder / MODEL_CONFIG}: model_type {model_type!r} is not one of {', '.join(KNOWN_MODEL_TYPES)}; "
                          "which tokenizer class transformers picks for it is not known to the scoring frontend")
    if model_type == "mistral" and (folder / "tekken.json").is_file() and importlib.util.find_spec("mistral_common"):
        raise NotAsWritten(f"{folder / 'tekken.json'}: transformers tokenizes this Mistral model with mistral-common, not "
                          f"{TOKENIZER_FILE}; the scoring frontend cannot promise its ids")
    if model_type in BACKEND_MODEL_TYPES or (named in AS_WRITTEN and model_type not in OWN_CLASS_MODEL_TYPES):
        return
    chosen = named if named and model_type not in OWN_CLASS_MODEL_TYPES else f"{model_type}'s own class"
    raise NotAsWritten(
        f"{source}: tokenizer_class {named!r} with model_type {model_type!r}: transformers loads it as {chosen}, which "
        f"rebuilds the normalizer, pre-tokenizer and decoder from its own code rather than running {TOKENIZER_FILE}, so "
        f"the scoring frontend (which runs {TOKENIZER_FILE} without transformers) cannot promise the same token ids; it "
        f"takes tokenizer_class {' or '.join(AS_WRITTEN)} (model_type not {', '.join(OWN_CLASS_MODEL_TYPES)}), or a "
        f"{' or '.join(BACKEND_MODEL_TYPES)} model")


def _added_token(value, **defaults):
    """A tokenizers.AddedToken from a string or a saved one ({"content": ..., "__type": "AddedToken"})."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        fields = {k: v for k, v in value.items() if k != "__type"}
        return AddedToken(fields.pop("content"), **fields)
    return AddedToken(value, **defaults) if defaults else value


def _special_tokens(folder: Path, settings: dict, backend) -> dict:
    """{"named": {attribute: token}, "extra": [token], "added": [AddedToken]} as
    tokenization_utils_base._from_pretrained and PreTrainedTokenizerBase.__init__ gather them."""
    from tokenizers import AddedToken

    init = dict(settings)
    if "additional_special_tokens" in init:
        init.setdefault("extra_special_tokens", init.pop("additional_special_tokens"))
    if "added_tokens_decoder" in init:
        added = {int(i): _added_token(t) for i, t in init["added_tokens_decoder"].items()}
    else:
        _read_legacy_files(folder, init)
        added = backend.get_added_tokens_decoder()
    by_content = {t.content: t for t in added.values()}
    extra = init.get("extra_special_tokens")
    named = {}
    if isinstance(extra, dict):
        named.update(extra)
        extra = []
    for key, value in init.items():
        if key.endswith("_token") and (isinstance(value, (str, AddedToken)) or (isinstance(value, dict) and "content" in value)):
            named[key] = _added_token(value)
    for key in NAMED_TOKENS:
        if named.get(key) is not None:
            named[key] = by_content.get(str(named[key]), named[key])
    extra = [_added_token(t) for t in (extra or [])]
    return {"named": named, "extra": extra, "added": [added[i] for i in sorted(added)]}


def _read_legacy_files(folder: Path, init: dict) -> None:
    """What a tokenizer_config.json without added_tokens_decoder leaves to older files:
    special_tokens_map.json's tokens override its own (added_tokens.json is refused)."""
    for key, value in _read_json(folder / SPECIAL_TOKENS_MAP).items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = _added_token({k: v for k, v in value.items() if k != "special"}, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            extra = list(init.get("extra_special_tokens") or [])
            value = extra + [t for t in (_added_token(v) for v in value) if t not in extra]
        init[key] = value
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    if (folder / ADDED_TOKENS_FILE).is_file():
        raise ConfigError(f"{folder / ADDED_TOKENS_FILE}: legacy added tokens without added_tokens_decoder in "
                          f"{CONFIG_FILE} are not read by the scoring frontend")


def _add_special_tokens(backend, special: dict) -> None:
    """The added and special tokens as TokenizersBackend.__init__ and _post_init add them."""
    from tokenizers import AddedToken

    present = {repr(t) for t in backend.get_added_tokens_decoder().values()}
    to_add = [t for t in special["added"] if repr(t) not in present]
    encoder = [t.content for t in backend.get_added_tokens_decoder().values()] + [str(t) for t in to_add]
    for token in [*special["named"].values(), *special["extra"]]:
        if token is not None and str(token) not in encoder and token not in to_add:
            to_add.append(token)
    named = {str(t) for t in special["named"].values() if t}
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)
    post = [t if isinstance(t, AddedToken) else AddedToken(t, special=True, normalized=False)
            for t in [*special["named"].values(), *special["extra"]] if t is not None]
    if post:
        backend.add_special_tokens(post)


def _token_id(backend, token, unk) -> int | None:
    """transformers' convert_tokens_to_ids for one special token: its id, else the unknown token's."""
    if token is None:
        return None
    found = backend.token_to_id(str(token))
    return found if found is not None or unk is None else backend.token_to_id(str(unk))
