"""What a checkpoint's config.json says that more than one process reads, without transformers
(so without torch): its family (the supported architectures) and its context length. The engine's
ModelSpec (model/spec.py) builds on it; the scoring frontend bounds prompts by the context length.
"""

from __future__ import annotations

import json
import os

from .errors import ConfigError, UnsupportedModelError

# architecture name -> family. All share the Llama layout (Phi-3 stores q/k/v and gate/up already
# fused, as the executor wants them); the flags below (biases, q/k norm, Gemma's norms, scales,
# activation, windows and soft-capping) are what differs. Each family's causal LM, its bare model
# (an embedding model saved without the LM head, as Qwen3-Embedding is) and its sequence classifier
# (a `score` head: classifiers and reward models).
_FAMILY_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma2": "Gemma2",
                   "gemma3": "Gemma3Text", "phi3": "Phi3"}
# the model's head, by what the architecture's name ends with: an LM head (scores tokens), none
# (embeddings), a sequence classification head
LM_HEAD, NO_HEAD, CLASSIFIER_HEAD = "lm", "embedding", "classifier"
_HEAD_SUFFIXES = {"ForCausalLM": LM_HEAD, "Model": NO_HEAD, "ForSequenceClassification": CLASSIFIER_HEAD}
SUPPORTED_ARCHITECTURES = {("Gemma3" if fam == "gemma3" and suffix == "ForCausalLM" else cls) + suffix: fam
                           for suffix in _HEAD_SUFFIXES for fam, cls in _FAMILY_CLASSES.items()}
GEMMA = ("gemma2", "gemma3")


def head_of(architecture: str) -> str:
    """LM_HEAD, NO_HEAD or CLASSIFIER_HEAD: what a supported architecture's checkpoint ends in."""
    return next(head for suffix, head in _HEAD_SUFFIXES.items() if architecture.endswith(suffix))


def label_names(id2label: dict | None, num_labels: int) -> tuple[str, ...]:
    """A classifier's label names in id order: id2label's (its keys ints, or their strings as
    config.json writes them), LABEL_<i> where it names none (transformers' default)."""
    names = id2label or {}
    return tuple(str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))


def class_labels(config: dict) -> tuple[str, ...]:
    """A sequence classifier's label names from its config.json, as transformers counts them:
    id2label's length, else num_labels, else 2."""
    id2label = config.get("id2label") if isinstance(config.get("id2label"), dict) else None
    return label_names(id2label, len(id2label) if id2label else int(config.get("num_labels", 2)))


def read_config(folder: str) -> tuple[dict, str]:
    """(`folder`/config.json as a dict, its family); ConfigError when there is none,
    UnsupportedModelError when it names no supported architecture."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model folder {folder!r} has no config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    archs = (config.get("architectures") if isinstance(config, dict) else None) or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported model architecture {archs!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return config, SUPPORTED_ARCHITECTURES[arch]


def context_length_of(folder: str) -> int:
    """ModelSpec.from_folder(folder).context_length from config.json alone, without transformers
    (which loads torch): what the scoring frontend bounds prompts by. The same rule as
    ModelSpec.context_length, with transformers' config defaults for the window a config.json may
    leave out (tests/frontend/test_tokenizer_file.py compares the two on every family)."""
    config, family = read_config(folder)
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or positions < 1:
        raise ConfigError(f"{folder}/config.json: max_position_embeddings is {positions!r}; the scoring frontend needs "
                          "it (or max_input_len set in the engine's settings)")
    if family in GEMMA or family == "phi3":
        window = None  # windows per layer (Gemma) or at every layer (Phi-3) that the kernels honour at any length
    elif family in ("qwen2", "qwen3"):
        window = config.get("sliding_window", 4096) if config.get("use_sliding_window", False) else None
    else:
        window = config.get("sliding_window", 4096 if family == "mistral" else None)
    return min(positions, int(window)) if window else positions
