"""How a checkpoint says it is pooled, read from its own files as TEI and vLLM read them, without
torch (the engine's model/pooling.py and the scoring frontend both read it).

    files = read_pooling_files(folder)   # None: no sentence-transformers files in the folder
    files.mode, files.normalize, files.prompts, files.default_prompt_name

sentence-transformers saves a pipeline of modules (modules.json): the Transformer, then Pooling
(its folder's config.json: which pooling_mode_* is on), then optionally Normalize (L2);
config_sentence_transformers.json names prompts (e.g. {"query": "Instruct: ...\\nQuery: "}) that
are prepended to a text asked for with that name. Modules this engine does not compute (Dense
projections, other poolings) are refused at load with ConfigError naming them, never ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .checkpoint import CLASSIFIER_HEAD
from .errors import ConfigError

POOLING_MODES = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys -> ours; the rest (max, mean_sqrt_len, weightedmean) are refused
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULE = "sentence_transformers.models."
_IGNORED_MODULES = ("Transformer",)  # the model itself: what the engine computes


@dataclass(frozen=True)
class PoolingFiles:
    mode: str  # one of POOLING_MODES
    normalize: bool  # a Normalize module follows the pooling
    prompts: dict[str, str] = field(default_factory=dict)  # named prompts, prepended to a text
    default_prompt_name: str | None = None  # the prompt used when a request names none


def read_pooling_files(folder: str) -> PoolingFiles | None:
    """The sentence-transformers pooling of `folder` (modules.json and what it points to), or None
    where the folder has no modules.json. ConfigError names a file that cannot be read or a module
    or pooling mode the engine does not compute."""
    path = os.path.join(folder, "modules.json")
    if not os.path.isfile(path):
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{path}: expected a list of modules")
    mode, normalize = None, False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).removeprefix(_ST_MODULE)
        if kind == "Pooling":
            mode = _pooling_mode(os.path.join(folder, str(module.get("path", "")), "config.json"))
        elif kind == "Normalize":
            normalize = True
        elif kind not in _IGNORED_MODULES:
            raise ConfigError(f"{path}: module {module.get('type')!r} ({module.get('path')!r}) is not supported: "
                              "the engine pools and normalises only (no Dense or other projection after the pooling)")
    if mode is None:
        raise ConfigError(f"{path}: no sentence_transformers.models.Pooling module")
    prompts, default = _named_prompts(os.path.join(folder, "config_sentence_transformers.json"))
    return PoolingFiles(mode, normalize, prompts, default)


def _pooling_mode(path: str) -> str:
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    if config.get("include_prompt", True) is False:
        raise ConfigError(f"{path}: include_prompt false (pooling that leaves out the prompt's tokens) is not supported")
    unsupported = [k for k in _ST_UNSUPPORTED if config.get(k)]
    on = [ours for key, ours in _ST_MODES.items() if config.get(key)]
    if unsupported or len(on) != 1:
        raise ConfigError(f"{path}: exactly one of {', '.join(_ST_MODES)} must be true (supported: last token, mean, "
                          f"first token); got {', '.join(unsupported + [k for k in _ST_MODES if config.get(k)]) or 'none'}")
    return on[0]


def _named_prompts(path: str) -> tuple[dict[str, str], str | None]:
    if not os.path.isfile(path):
        return {}, None
    config = _read_json(path)
    prompts = config.get("prompts") or {} if isinstance(config, dict) else None
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ConfigError(f"{path}: prompts must map names to texts")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ConfigError(f"{path}: default_prompt_name {default!r} is not one of the prompts ({', '.join(prompts) or 'none'})")
    return dict(prompts), default


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


# a checkpoint with no sentence-transformers files embeds as vLLM embeds a decoder: its last
# token's final hidden state, L2-normalised
DEFAULT_POOLING = PoolingFiles("last", True)


def pooling_for(folder: str, head: str) -> PoolingFiles | None:
    """How the checkpoint in `folder` embeds: its sentence-transformers files, else DEFAULT_POOLING;
    None for a sequence classifier (it answers classify, not embed). `head`: checkpoint.head_of."""
    if head == CLASSIFIER_HEAD:
        return None
    return read_pooling_files(folder) or DEFAULT_POOLING
