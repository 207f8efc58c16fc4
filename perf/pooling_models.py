"""The pooled checkpoints perf/bench_pooling.py serves (issue 50), built from the default model
(SmolLM2-135M-Instruct, float32) in folders beside it, once (rebuilt when the recipe changes):

* an embedder: the causal LM's final hidden state at the last token, L2-normalised, as a
  sentence-transformers folder (modules.json: Transformer, Pooling with pooling_mode_lasttoken,
  Normalize; config_sentence_transformers.json with prompts {"query": INSTRUCTION, "document": ""}).
  The model's files are symlinks to the default model's.
* a one-label reward model: config.json with architectures ["LlamaForSequenceClassification"],
  num_labels 1, problem_type "regression" (a raw score: vLLM's /classify then applies no sigmoid),
  the default model's tensors (already named model.*) as shard 1 (a symlink) and score.weight
  [1, hidden] (seeded normal, std 0.02) as shard 2, tied together by model.safetensors.index.json.

    .venv/bin/python -m perf.pooling_models            # build both, print their folders
    .venv/bin/python -m perf.pooling_models --check    # also load each in transformers (no missing keys)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from perf import benchutil as bu

# ~198 tokens in SmolLM2's tokenizer; the prompt every text of the prefix workload starts with.
INSTRUCTION = (
    "Instruct: You are the retrieval component of a search system over a large library of technical reports, "
    "product manuals, support tickets, news articles and encyclopedia entries. Given the query below, produce a "
    "representation that places it close to the passages that answer it and far from passages that merely share "
    "its words. Prefer passages that state facts, give step-by-step procedures, quote exact figures, or explain "
    "the cause of a problem and how to fix it. Treat spelling mistakes, abbreviations and informal wording in the "
    "query as the user would mean them. Ignore greetings, signatures, boilerplate and advertising. When the query "
    "names a product, a version, a date or a place, passages about that exact product, version, date or place are "
    "more relevant than passages about similar ones. When the query asks a yes or no question, passages that "
    "settle it either way are relevant. The query may be long; the relevant passages may use other words for "
    "the same things.\nQuery: "
)
EMBED_SUFFIX, REWARD_SUFFIX = "-embed-last", "-reward"
SCORE_SEED, SCORE_STD = 50, 0.02
MODEL_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "generation_config.json")
RECIPE_FILE = "pooling_recipe.json"  # what the folder was built from; a different recipe rebuilds it


def embedder_files(hidden_size: int) -> dict[str, object]:
    """The sentence-transformers files of a last-token, normalised embedder (path -> JSON)."""
    return {
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
        "1_Pooling/config.json": {
            "word_embedding_dimension": hidden_size, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
            "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True,
        },
        "config_sentence_transformers.json": {
            "prompts": {"query": INSTRUCTION, "document": ""}, "default_prompt_name": None, "similarity_fn_name": "cosine",
        },
    }


def reward_config(base_config: dict) -> dict:
    config = dict(base_config, architectures=["LlamaForSequenceClassification"], num_labels=1,
                  id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0}, problem_type="regression")
    config.pop("_model_name_or_path", None)
    return config


def ensure_embedder(base: str | None = None) -> str:
    """The embedder folder beside the default model (built if missing or stale); its path."""
    base = base or bu.default_model_dir()
    config = _read_json(Path(base) / "config.json")
    files = {"config.json": config, **embedder_files(config["hidden_size"])}
    return _ensure(base, base + EMBED_SUFFIX, files, shards=False)


def ensure_reward_model(base: str | None = None) -> str:
    """The one-label reward model folder beside the default model (built if missing or stale); its path."""
    base = base or bu.default_model_dir()
    files = {"config.json": reward_config(_read_json(Path(base) / "config.json"))}
    return _ensure(base, base + REWARD_SUFFIX, files, shards=True)


def _ensure(base: str, dest: str, files: dict, shards: bool) -> str:
    recipe = {"base": os.path.realpath(base), "files": files, "shards": shards, "score": [SCORE_SEED, SCORE_STD],
              "base_weights": _file_id(Path(base) / "model.safetensors")}
    if (Path(dest) / RECIPE_FILE).is_file() and _read_json(Path(dest) / RECIPE_FILE) == recipe:
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=Path(dest).name + ".", dir=Path(dest).parent))
    try:
        for name in MODEL_FILES:
            source = Path(base) / name
            if source.is_file() and not (shards and name == "model.safetensors"):
                os.symlink(os.path.realpath(source), tmp / name)
        if shards:
            _write_reward_shards(Path(base), tmp)
        for name, data in files.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_text(json.dumps(data, indent=2) + "\n")
        (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
        if os.path.lexists(dest):
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    bu.log(f"built {dest}")
    return dest


def _write_reward_shards(base: Path, dest: Path) -> None:
    """Shard 1: the default model's tensors (a symlink); shard 2: score.weight; the index naming both."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    os.symlink(os.path.realpath(base / "model.safetensors"), dest / first)
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        hidden = f.get_slice("model.norm.weight").get_shape()[0]
    generator = torch.Generator().manual_seed(SCORE_SEED)
    score = torch.randn(1, hidden, generator=generator, dtype=torch.float32) * SCORE_STD
    save_file({"score.weight": score}, str(dest / second), metadata={"format": "pt"})
    size = (base / "model.safetensors").stat().st_size + (dest / second).stat().st_size
    index = {"metadata": {"total_size": size}, "weight_map": {**{n: first for n in names}, "score.weight": second}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _file_id(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _read_json(path: Path):
    with open(path) as f:
        return json.load(f)


def check_loads(embedder: str, reward: str) -> list[str]:
    """Load both folders in transformers (the reward model as AutoModelForSequenceClassification):
    lines saying what loaded and which keys were missing or unexpected (none expected)."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    out = []
    for folder, cls in ((embedder, AutoModel), (reward, AutoModelForSequenceClassification)):
        model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
        problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        out.append(f"{cls.__name__}({folder}): {type(model).__name__}, "
                   + (f"problems {problems}" if problems else "no missing, unexpected or mismatched keys"))
        if cls is AutoModelForSequenceClassification:
            out.append(f"  score.weight[0, :4] = {model.score.weight[0, :4].tolist()}, num_labels {model.config.num_labels}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Build the embedder and reward-model folders perf/bench_pooling.py serves.")
    p.add_argument("--check", action="store_true", help="also load both in transformers and report missing keys")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    embedder, reward = ensure_embedder(), ensure_reward_model()
    print(f"embedder: {embedder}\nreward model: {reward}")
    if args.check:
        print("\n".join(check_loads(embedder, reward)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
