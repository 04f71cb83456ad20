"""What a paper config meets on real data and real hub checkpoints, checked offline: ``${VAR}`` in config strings,
text limits that follow the model, hub checkpoints in the dtype they ship in, chat templates, QuickGELU for
OpenAI's CLIP weights."""

from __future__ import annotations

import copy

import pytest
import yaml

from rayfed.config import load_config
from rayfed.config.loading import dump_config
from rayfed.errors import ConfigError

MOSAIC_SOURCE = "hf:${DRAKE_ROOT}/client0/task0"


def _with_task_sources(tiny_run: dict, *sources: str) -> dict:
    run = copy.deepcopy(tiny_run)
    data = run.pop("data")
    run["data"] = {"tasks": [
        {"name": f"t{index}", "source": source, "synthetic": data["synthetic"], "partition": data["partition"],
         "num_clients": 2} for index, source in enumerate(sources)]}
    run["federation"]["clients_per_round"] = 2
    return run


# ${VAR} in config strings ----------------------------------------------------------------------------------------
def test_a_braced_variable_in_a_yaml_config_expands_and_the_dumped_config_holds_its_value(tiny_run, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setenv("DRAKE_ROOT", "/data/drake")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_with_task_sources(tiny_run, "synthetic", MOSAIC_SOURCE)))
    config = load_config(path)
    assert config.data.tasks[1].source == "hf:/data/drake/client0/task0"
    dump_config(config, tmp_path / "config.yaml")
    rerun = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert rerun["data"]["tasks"][1]["source"] == "hf:/data/drake/client0/task0"


def test_variables_expand_in_dicts_and_overrides_and_only_the_braced_form(tiny_run, monkeypatch):
    monkeypatch.setenv("RUN_NAME", "drake")
    monkeypatch.setenv("ROOT", "/data")
    config = load_config({**tiny_run, "name": "${RUN_NAME}-$RUN_NAME"}, ["model.pretrained=${ROOT}/w.pt"])
    assert config.name == "drake-$RUN_NAME"
    assert config.model.pretrained == "/data/w.pt"
    assert tiny_run["name"] == "tiny"  # the caller's dict is left as it was


def test_an_unset_variable_is_refused_naming_it_and_the_field(tiny_run, monkeypatch):
    monkeypatch.delenv("DRAKE_ROOT", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(_with_task_sources(tiny_run, "synthetic", "synthetic", MOSAIC_SOURCE))
    message = str(info.value)
    assert message.startswith(f"data.tasks.2.source = {MOSAIC_SOURCE!r} uses the environment variable DRAKE_ROOT, "
                              "which is not set; export it")
    assert "\n" not in message and message.endswith(".")
