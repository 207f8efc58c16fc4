"""A checkpoint's sentence-transformers files read as TEI and vLLM read them: the pooling mode, a
Normalize module, named prompts; what the engine does not compute is refused at load, naming it."""

from __future__ import annotations

import json

import pytest

from prefillonly.contract.checkpoint import CLASSIFIER_HEAD, LM_HEAD, NO_HEAD
from prefillonly.contract.errors import ConfigError
from prefillonly.contract.pooling_files import DEFAULT_POOLING, PoolingFiles, pooling_for, read_pooling_files

from .test_pooling import write_st_pooling


@pytest.mark.parametrize("mode, ours", [("lasttoken", "last"), ("mean_tokens", "mean"), ("cls_token", "cls")])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_mode_and_normalisation_come_from_the_files(tmp_path, mode, ours, normalize):
    write_st_pooling(tmp_path, mode, normalize, {"query": "Q: ", "document": ""}, "query")
    assert read_pooling_files(str(tmp_path)) == PoolingFiles(ours, normalize, {"query": "Q: ", "document": ""}, "query")


def test_without_files_a_decoder_embeds_its_last_token_normalised_and_a_classifier_does_not_embed(tmp_path):
    assert read_pooling_files(str(tmp_path)) is None
    assert pooling_for(str(tmp_path), LM_HEAD) == pooling_for(str(tmp_path), NO_HEAD) == DEFAULT_POOLING == PoolingFiles("last", True)
    write_st_pooling(tmp_path, "mean_tokens", False)
    assert pooling_for(str(tmp_path), CLASSIFIER_HEAD) is None


def _edit(file, **changes):
    data = json.loads(file.read_text())
    if isinstance(data, dict):  # a pooling config: keys changed
        data.update(changes)
    else:  # modules.json: a module added
        data.append(changes)
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("edit, message", [
    (lambda d: _edit(d / "1_Pooling" / "config.json", pooling_mode_max_tokens=True), "pooling_mode_max_tokens"),
    (lambda d: _edit(d / "1_Pooling" / "config.json", pooling_mode_mean_tokens=True), "exactly one of"),
    (lambda d: _edit(d / "1_Pooling" / "config.json", pooling_mode_lasttoken=False), "got none"),
    (lambda d: _edit(d / "1_Pooling" / "config.json", include_prompt=False), "include_prompt false"),
    (lambda d: _edit(d / "modules.json", idx=3, path="3_Dense", type="sentence_transformers.models.Dense"), "Dense"),
    (lambda d: (d / "modules.json").write_text("[{"), "cannot read"),
    (lambda d: (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"q": "Q"}, "default_prompt_name": "x"})),
     "default_prompt_name 'x' is not one of the prompts"),
    (lambda d: (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": ["Q"]})), "prompts must map names"),
])
def test_what_the_engine_does_not_compute_is_refused_naming_it(tmp_path, edit, message):
    write_st_pooling(tmp_path, "lasttoken", True)
    edit(tmp_path)
    with pytest.raises(ConfigError, match=message):
        read_pooling_files(str(tmp_path))
