"""What docs/extending.md tells a method author, checked against the engine: partial-parameter training, the default
model's parameter names and head, the default hooks' state layout, labels; and what `rayfed run` says on Ctrl-C."""

from __future__ import annotations

import importlib
import re
import runpy
from pathlib import Path

import pytest
import torch

from rayfed.cli import main
from rayfed.config import load_config
from rayfed.results.checkpoint import latest_round

ROOT = Path(__file__).resolve().parents[1]
EXTENDING = (ROOT / "docs" / "extending.md").read_text()


def _section(title: str) -> str:
    """The text of docs/extending.md's section ``### <title>``, up to the next heading."""
    match = re.search(rf"^### {re.escape(title)}\n(.*?)(?=^#)", EXTENDING, re.S | re.M)
    assert match, f"docs/extending.md has no section '### {title}'"
    return match.group(1)


# Labels -----------------------------------------------------------------------------------------------------------
def test_a_method_is_labelled_alike_by_its_name_its_import_path_its_class_and_a_built_one(tmp_path, monkeypatch):
    (tmp_path / "labelled_methods.py").write_text(
        "import rayfed\n\n\n@rayfed.register_method('scaled-label')\nclass Scaled(rayfed.Method):\n    pass\n\n\n"
        "class Unregistered(rayfed.Method):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("labelled_methods")

    def label(name) -> str:
        return load_config({"methods": [name]}).methods[0].label

    spellings = ("scaled-label", "labelled_methods:Scaled", module.Scaled, module.Scaled())
    assert [label(name) for name in spellings] == ["scaled-label"] * 4
    unregistered = ("labelled_methods:Unregistered", module.Unregistered, module.Unregistered())
    assert [label(name) for name in unregistered] == ["Unregistered"] * 3
    assert label({"name": "labelled_methods:Scaled", "label": "mine"}) == "mine"
    assert label({"name": "labelled_methods:Scaled", "post_train_steps": 2}) == "scaled-label+post"
    assert label("rayfed.methods:Ditto") == "ditto"  # a built-in's class by its import path
    with pytest.raises(ValueError, match="the label 'scaled-label' is used twice"):
        load_config({"methods": ["scaled-label", "labelled_methods:Scaled"]})


# Ctrl-C -----------------------------------------------------------------------------------------------------------
def test_ctrl_c_says_what_the_run_kept_and_the_command_that_resumes_it(tiny_run, tmp_path, monkeypatch, capsys):
    """Stopped in round 1 of the second method (just after its checkpoint): exit status 130, no traceback, one
    sentence naming the first method's results, the second's checkpoint round and the third's restart; the printed
    command then finishes the run."""
    import yaml

    from rayfed.simulation.run import Simulation

    tiny_run["federation"].update(rounds=2, eval_every=2, checkpoint_every=1)
    tiny_run["methods"] = ["local", "fedavg", "fedprox"]
    tiny_run["placement"]["executor"] = "local"
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_run))
    checkpoint = Simulation._checkpoint

    def stopped_at_fedavg_round_1(sim, label, rounds_done, counters):
        checkpoint(sim, label, rounds_done, counters)
        if (label, rounds_done) == ("fedavg", 1):
            raise KeyboardInterrupt

    monkeypatch.setattr(Simulation, "_checkpoint", stopped_at_fedavg_round_1)
    run_dir = tmp_path / "run"
    assert main(["run", str(config), "--out", str(run_dir), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    sentence, command = err.strip().split("\n")[-2:]
    assert sentence == (f"rayfed: interrupted; {run_dir} keeps local's results, fedavg's checkpoint of round 1 of 2; "
                        "fedprox restarts at round 1. Resume it with:")
    assert command.strip() == f"rayfed run --resume {run_dir} --quiet"
    monkeypatch.setattr(Simulation, "_checkpoint", checkpoint)
    assert main(command.split()[1:]) == 0
    assert latest_round(run_dir / "checkpoints", "fedprox") == 2 and (run_dir / "summary.json").is_file()


def test_ctrl_c_before_the_run_wrote_anything_says_to_run_the_command_again(tmp_path, monkeypatch, capsys):
    from rayfed.simulation.run import Simulation

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Simulation, "__init__", interrupted)
    assert main(["run", "configs/quickstart.yaml", "--out", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err == ("rayfed: interrupted before the run wrote anything to resume from; run the same "
                                       "command again.\n")
