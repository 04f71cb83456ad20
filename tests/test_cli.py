from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayfed.cli import main, parse_args


@pytest.fixture
def config_file(tiny_run, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_run))
    return path


@pytest.mark.parametrize("argv", [
    ["run", "c.yaml", "seed=1", "--quiet", "train.lr=0.1"],
    ["run", "c.yaml", "--quiet", "seed=1", "train.lr=0.1"],
    ["run", "--quiet", "c.yaml", "seed=1", "train.lr=0.1"],
])
def test_overrides_may_come_before_or_after_options(argv):
    args = parse_args(argv)
    assert args.config == "c.yaml" and args.quiet and args.overrides == ["seed=1", "train.lr=0.1"]


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["run", "c.yaml", "--quiet", "--nope"])
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


PLUGIN_MODULE = """
import rayfed


@rayfed.register_method("fedavgm")
class FedAvgM(rayfed.Method):
    \"\"\"FedAvg with server momentum.\"\"\"
"""


def test_list_prints_one_line_per_registered_thing(capsys, tmp_path, monkeypatch):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    kinds = {line.split()[0] for line in lines}
    assert kinds == {"method", "backbone", "dataset", "partitioner", "client_model", "task_kind", "preparer"}
    assert "mome" in {line.split()[1] for line in lines if line.startswith("client_model")}
    assert {"local", "fedavg", "fedprox", "ditto"} <= {line.split()[1] for line in lines if line.startswith("method")}
    assert any(line.split()[1] == "dirichlet" for line in lines if line.startswith("partitioner"))
    assert {"classification", "text_generation"} <= {line.split()[1] for line in lines if line.startswith("task_kind")}
    # what a user's module registers is listed next to the built-ins, marked with its module
    (tmp_path / "my_plugins.py").write_text(PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["list", "--import", "my_plugins"]) == 0
    [mine] = [line for line in capsys.readouterr().out.splitlines() if "fedavgm" in line]
    assert mine.split()[:2] == ["method", "fedavgm"] and mine.endswith("[my_plugins]")
    assert main(["list", "--import", "no_such_plugins"]) == 2
    assert "--import 'no_such_plugins'" in capsys.readouterr().err


def test_bad_value_prints_one_sentence_and_exits_2(config_file, capsys):
    assert main(["run", str(config_file), "data.partition.alpha=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayfed: error: data.partition.alpha = 0 is invalid") and "\n" not in err


def test_resume_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "no config.yaml" in capsys.readouterr().err


def test_run_applies_overrides_and_seed(config_file, tmp_path, capsys):
    out = tmp_path / "out"
    # the actors in this process (what the command line sets, not Ray)
    argv = ["run", str(config_file), "federation.rounds=2", "--seed", "11", "--out", str(out), "--quiet",
            "placement.executor=local"]
    assert main(argv) == 0
    assert f"results: {out}" in capsys.readouterr().out
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["federation"]["rounds"] == 2 and saved["seed"] == 11 and saved["placement"]["executor"] == "local"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["seed"] == 11 and "fedavg" in summary["methods"]


WORKING_FOLDER_METHOD = """
import rayfed
from rayfed.methods import FedAvg


@rayfed.register_method("my_fedavg")
class MyFedAvg(FedAvg):
    \"\"\"A researcher's first method: a built-in one, subclassed in a module of the working folder.\"\"\"
"""


def test_run_imports_a_module_of_the_working_folder(tiny_run, tmp_path):
    """The `rayfed` command, started in the folder holding mymethods.py, imports it as `python -m` would."""
    (tmp_path / "mymethods.py").write_text(WORKING_FOLDER_METHOD)
    tiny_run.update(imports=["mymethods"], methods=["my_fedavg"])
    tiny_run["federation"].update(rounds=1, eval_every=1)
    tiny_run["placement"]["executor"] = "local"
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(tiny_run))
    command = Path(sys.executable).with_name("rayfed")
    done = subprocess.run([str(command), "run", "mine.yaml", "--out", "out", "--quiet"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "my_fedavg" in json.loads((tmp_path / "out" / "summary.json").read_text())["methods"]


def test_python_m_rayfed_is_the_rayfed_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rayfed", "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: rayfed ") and "{run,tune,bench,data,prepare,pretrain,list}" in done.stdout
