"""rayfed/compat.py, every migration in one place: each old form is still read (an earlier config field name, an
older checkpoint) or refused in one sentence saying what to write instead (a moved module or script). The other
migrations keep their tests beside what they guard: a field a plug-in replaced (tests/test_config.py), a removed
hyperparameter (tests/test_tap.py) and a removed method attribute (tests/test_methods.py)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch

from rayfed import compat
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.results.checkpoint import load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_an_earlier_field_name_is_read_and_setting_both_names_is_refused(tiny_run):
    options = tiny_run["data"]["synthetic"]
    assert load_config(tiny_run).data.options == options  # conftest's run writes the earlier name
    tiny_run["data"]["options"] = options
    with pytest.raises(ConfigError, match=r"data\.synthetic and data\.options are both set; data\.synthetic is the old "
                                          r"name of data\.options, keep one"):
        load_config(tiny_run)


@pytest.mark.parametrize(("old", "script"), [
    ("rayfed.methods.experiments", "offline_runs.py or offline_twins.py"),
    ("rayfed.benchmarks.offline_twins", "offline_twins.py"),
    ("rayfed.methods.fedmosaic.costs", "fedmosaic_costs.py"),
    ("rayfed.methods.fedyolo.paper_configs", "fedyolo_configs.py"),
    ("rayfed.methods.tap.tables", "tap_tables.py"),
])
def test_a_script_that_left_the_package_fails_to_import_naming_its_command(old, script):
    assert all((ROOT / "benchmarks" / "papers" / name).is_file() for name in script.split(" or "))
    sentence = (rf"^{old.replace('.', '[.]')} is no longer part of the installed package: run python "
                rf"benchmarks/papers/{script.replace('.', '[.]')} from the repository's root "
                r"\(or with --repo PATH\)\.$")
    with pytest.raises(ImportError, match=sentence):
        importlib.import_module(old)
    with pytest.raises(ImportError, match=r"^rayfed\.methods\.experiments is no longer part of the installed package"):
        importlib.import_module("rayfed.methods.experiments.offline_runs")  # its package is asked for first


def test_a_plug_in_module_is_never_taken_for_a_moved_script():
    assert compat.moved_module("rayfed.methods.fedyolo.ladder") is None
    assert compat.moved_module("rayfed.methods.tap") is None
    module = "rayfed.methods.fedmosaic.task_groups"
    assert importlib.import_module(module).__name__ == module


def _older_checkpoint(tmp_path: Path, config: dict) -> None:
    """A checkpoint as rayfed wrote it before fingerprints: its meta.json holds the config alone."""
    round_dir = save_checkpoint(tmp_path, "fedavg", 2, {"global": {"w": torch.ones(2)}}, {0: {"personal": {}}},
                                {"config": config})
    meta = json.loads((round_dir / "meta.json").read_text())
    del meta["fingerprint"]
    (round_dir / "meta.json").write_text(json.dumps(meta))


def test_an_older_checkpoint_without_a_fingerprint_continues_with_its_own_config_only(tmp_path):
    config = {"name": "t", "seed": 1, "train": {"lr": 0.1}}
    _older_checkpoint(tmp_path, config)
    assert load_checkpoint(tmp_path, "fedavg", config).round == 2
    with pytest.raises(ConfigError, match=r"train\.lr = 0\.1 there, 0\.2 now"):
        load_checkpoint(tmp_path, "fedavg", {**config, "train": {"lr": 0.2}})
