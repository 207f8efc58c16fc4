"""perf/pooling_models.py and perf/bench_pooling.py without a server: the checkpoint folders built
from a tiny stand-in of the default model (their files, the reward shard and index, a rebuild only
when the recipe changes) and the bench's checks and table on a made-up result. Fast; no model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from perf import bench_pooling as bp
from perf import pooling_models as pm
from prefillonly.contract.pooling_files import read_pooling_files


@pytest.fixture
def base(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                                    "_model_name_or_path": "x"}))
    (folder / "tokenizer.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8), "model.norm.weight": torch.ones(8)},
              str(folder / "model.safetensors"))
    return str(folder)


def test_embedder_folder_is_a_last_token_normalised_sentence_transformer(base):
    folder = pm.ensure_embedder(base)
    files = read_pooling_files(folder)  # the engine's and the frontend's reader
    assert (files.mode, files.normalize) == ("last", True)
    assert files.prompts == {"query": pm.INSTRUCTION, "document": ""}
    pooling = json.loads(open(f"{folder}/1_Pooling/config.json").read())
    assert pooling["word_embedding_dimension"] == 8 and pooling["pooling_mode_lasttoken"]
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        assert set(f.keys()) == {"model.embed_tokens.weight", "model.norm.weight"}


def test_reward_folder_has_the_base_tensors_and_a_seeded_score_head(base):
    folder = pm.ensure_reward_model(base)
    config = json.loads(open(f"{folder}/config.json").read())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    assert config["id2label"] == {"0": "LABEL_0"} and "_model_name_or_path" not in config
    index = json.loads(open(f"{folder}/model.safetensors.index.json").read())["weight_map"]
    assert set(index) == {"model.embed_tokens.weight", "model.norm.weight", "score.weight"}
    with safe_open(f"{folder}/{index['score.weight']}", "pt") as f:
        score = f.get_tensor("score.weight")
    assert score.shape == (1, 8) and 0 < score.std() < 0.1
    assert read_pooling_files(folder) is None  # a classifier, no sentence-transformers files


def test_a_folder_is_rebuilt_only_when_its_recipe_changes(base, monkeypatch):
    folder = pm.ensure_embedder(base)
    stamp = (Path(folder) / pm.RECIPE_FILE).stat().st_mtime_ns
    assert pm.ensure_embedder(base) == folder and (Path(folder) / pm.RECIPE_FILE).stat().st_mtime_ns == stamp
    monkeypatch.setattr(pm, "INSTRUCTION", "Instruct: other\nQuery: ")
    pm.ensure_embedder(base)
    assert read_pooling_files(folder).prompts["query"] == "Instruct: other\nQuery: "


def test_checks_and_table_on_a_made_up_result():
    vectors = np.eye(3).tolist()
    work = {"prefix_order": [0, 1, 0, 1]}
    rep = {"embed": {s: {"s": t, "embeddings": vectors} for s, t in (("ours", 1.0), ("vllm", 2.0))},
           "prefix": {s: {"s": t, "embeddings": [vectors[i] for i in work["prefix_order"]]} for s, t in (("ours", 1.0), ("vllm", 5.0))},
           "reward": {"ours": {"s": 1.0, "scores": [[0.1, 0.3]]}, "vllm": {"s": 2.0, "scores": [[0.1, 0.2]]}}}
    c = bp.checks(rep, work)
    assert c["embed_cosine"]["min"] == pytest.approx(1.0) and c["prefix_repeat_ours"]["min"] == pytest.approx(1.0)
    assert c["reward"]["max_abs_gap"] == pytest.approx(0.1) and c["reward"]["same_best"] == 1
    result = {"args": {"only": list(bp.WORKLOADS)}, "reps": [rep],
              "tokens": {"embed": 10, "prefix": 20, "reward_ours": 5, "reward_vllm": 9}}
    rows = {r[0]: r for r in bp.table_rows(result)}
    assert rows[bp.LABELS["embed"]][3:5] == ["0.50x", "<= 0.7x (met)"]
    assert rows[bp.LABELS["prefix"]][3:5] == ["0.20x", "<= 0.3x (met)"]
    assert rows[bp.LABELS["reward"]][3:5] == ["0.50x", "<= 0.3x (missed)"]


def test_reward_request_and_reply_shapes():
    assert bp.ours_reward_body("m", "p\n", ["a", "b"]) == {"model": "m", "prompt": "p\n", "responses": ["a", "b"]}
    reply = {"data": [{"index": 1, "probs": [0.5]}, {"index": 0, "probs": [-1.0]}]}
    assert bp.classify_scores(reply) == [-1.0, 0.5]
