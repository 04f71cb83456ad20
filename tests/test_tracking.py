"""Experiment trackers following a run (rayfed.tracking), each read back offline with its own reader: TensorBoard's
event files with tensorboard's EventAccumulator, W&B's offline run files with its datastore and protobuf records,
MLflow's file store with its client. A run interrupted and resumed continues the same tracked runs, every round once;
without a tracker nothing is imported or recorded."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_RUN

from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.results.checkpoint import config_fingerprint
from rayfed.simulation import Simulation
from rayfed.tracking import RECORD_FILE, RunTracking, event_values

ROUNDS = 4
CONFIG = {**copy.deepcopy(TINY_RUN), "methods": ["fedavg", {"name": "ditto", "lam": 0.3}]}
CONFIG["federation"] = {**CONFIG["federation"], "rounds": ROUNDS, "eval_every": 1, "checkpoint_every": 2}
CONFIG["placement"] = {**CONFIG["placement"], "executor": "local"}
TRACKING_PACKAGES = ("tensorboard", "tensorboardX", "wandb", "mlflow")


class _Interrupt(Exception):
    pass


def _interrupt_ditto_at_round_3(sim, label, rounds_done):
    if label == "ditto" and rounds_done == 3:  # after round 3's evaluation; the last checkpoint is round 2's
        raise _Interrupt


@pytest.fixture
def wandb_home(tmp_path, monkeypatch) -> Path:
    """W&B's settings, cache and credentials in a folder of the test's own, with no API key."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(home / variable.lower()))
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(variable, raising=False)
    return home


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> dict:
    """A run of two methods followed by all three trackers, interrupted in ditto's round 3 and resumed."""
    folder = tmp_path_factory.mktemp("tracked")
    config = {**copy.deepcopy(CONFIG), "tracking": {
        "tensorboard": True, "wandb": {"mode": "offline", "tags": ["test"]},
        "mlflow": {"tracking_uri": (folder / "mlruns").as_uri(), "tags": {"team": "fl"}}}}
    run_dir = folder / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(folder))
        patch.delenv("WANDB_API_KEY", raising=False)
        with pytest.raises(_Interrupt):
            Simulation(config, out_dir=run_dir, callbacks=[_interrupt_ditto_at_round_3], progress=False).run()
        interrupted = json.loads((run_dir / RECORD_FILE).read_text())
        summary = Simulation.resume(run_dir, progress=False).run()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"run_dir": run_dir, "summary": summary, "events": events, "interrupted": interrupted,
            "record": json.loads((run_dir / RECORD_FILE).read_text()), "mlruns": folder / "mlruns"}


def _eval_means(events: list[dict], label: str, metric: str = "local_acc") -> dict[int, float]:
    return {e["round"]: e[metric] for e in events if e["event"] == "eval" and e["method"] == label}


def test_the_record_keeps_each_trackers_runs_and_the_resumed_run_continued_them(tracked):
    interrupted, record = tracked["interrupted"], tracked["record"]
    assert set(record) == {"tensorboard", "wandb", "mlflow"}
    for name in record:
        assert record[name]["ids"] == {**interrupted[name]["ids"], **record[name]["ids"]}  # the same runs, continued
        assert set(record[name]["ids"]) == {"", "fedavg", "ditto"}
        assert interrupted[name]["logged"]["ditto"] == [3, 1]  # round 3's evaluation was out before the interruption
        assert record[name]["logged"] == {"fedavg": [ROUNDS, 2], "ditto": [ROUNDS, 2]}  # up to each final evaluation


# TensorBoard ----------------------------------------------------------------------------------------------------
def _accumulator(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_event_files_hold_the_config_every_round_once_and_the_report(tracked):
    from tensorboard.plugins.hparams import plugin_data_pb2

    root = tracked["run_dir"] / "tensorboard" / "run"
    assert tracked["record"]["tensorboard"]["ids"] == {"": str(root), "fedavg": str(root / "fedavg"),
                                                       "ditto": str(root / "ditto")}
    ditto = _accumulator(root / "ditto")
    assert len(list((root / "ditto").glob("events.out.tfevents.*"))) == 2  # the interrupted run's and the resumed one's
    accuracy = ditto.Scalars("eval/local_acc")
    assert [event.step for event in accuracy] == list(range(1, ROUNDS + 1))  # round 3 once, though it ran twice
    assert [event.value for event in accuracy] == pytest.approx(list(_eval_means(tracked["events"], "ditto").values()))
    assert [event.step for event in ditto.Scalars("round/wall_s")] == list(range(1, ROUNDS + 1))
    assert "eval_std/local_acc" in ditto.Tags()["scalars"] and "round/up_bytes" in ditto.Tags()["scalars"]
    [content] = ditto.PluginTagToContent("hparams").values()  # the session's start; TensorBoard finds the metrics
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["train.lr"].number_value == pytest.approx(0.01)
    assert hparams["method.name"].string_value == "ditto" and hparams["method.params.lam"].number_value == 0.3
    assert "methods.0.name" not in hparams  # a method's run holds its own entry, not the others'

    run = _accumulator(root)
    assert {"report/curves", "report/clients"} <= set(run.Tags()["images"])
    texts = {tag.removesuffix("/text_summary"): run.Tensors(tag)[0].tensor_proto.string_val[0].decode()
             for tag in run.Tags()["tensors"]}
    assert "seed: 3" in texts["config"] and "fedavg" in texts["report.md"]
    assert json.loads(texts["summary.json"].strip("`").removeprefix("json\n")) == tracked["summary"]


# Weights & Biases -----------------------------------------------------------------------------------------------
def _wandb_runs(folder: Path) -> dict[str, dict]:
    """Every W&B run of the offline files under ``folder`` (a resumed run's files merged into one): its run record
    (group, name, job type, tags), config, history rows by step, summary and saved files."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    runs: dict[str, dict] = {}
    for file in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        store = datastore.DataStore()
        store.open_for_scan(str(file))
        run = None
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record.FromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = runs.setdefault(record.run.run_id, {"config": {}, "history": [], "files": [], "summary": {}})
                run.update(group=record.run.run_group, name=record.run.display_name, job_type=record.run.job_type,
                           tags=list(record.run.tags))
                run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.history.item})
            elif kind == "files":
                run["files"] += [item.path for item in record.files.files]
    return runs


def test_wandb_offline_files_hold_the_config_every_round_once_and_the_report(tracked):
    runs = _wandb_runs(tracked["run_dir"])
    ids = tracked["record"]["wandb"]["ids"]
    assert set(runs) == set(ids.values())
    assert {run["group"] for run in runs.values()} == {"run"}  # the run's folder name groups its methods
    assert {run["tags"][0] for run in runs.values()} == {"test"}
    ditto, config_run = runs[ids["ditto"]], runs[ids[""]]
    assert (ditto["name"], ditto["job_type"], config_run["job_type"]) == ("ditto", "method", "run")
    assert ditto["config"]["train.lr"] == 0.01 and ditto["config"]["method.params.lam"] == 0.3
    assert config_run["config"]["methods.1.name"] == "ditto"
    rows = [row for row in ditto["history"] if "eval/local_acc" in row]
    assert [row["_step"] for row in rows] == list(range(1, ROUNDS + 1))  # across both offline files, round 3 once
    means = list(_eval_means(tracked["events"], "ditto").values())
    assert [row["eval/local_acc"] for row in rows] == pytest.approx(means)
    assert {"round/wall_s", "round/down_bytes", "eval_std/local_acc"} <= set().union(*ditto["history"])
    assert {"summary.json", "report.md"} <= set(config_run["files"])
    assert any(row.get("report/curves/_type") == "image-file" for row in config_run["history"])


def test_where_actors_have_a_gpu_each_round_carries_its_gpu_peak_to_the_trackers(tmp_path, monkeypatch):
    import rayfed.actors.client as client_actor

    config = {**copy.deepcopy(CONFIG), "methods": ["fedavg"], "tracking": {"tensorboard": True}}
    config["federation"] = {**config["federation"], "rounds": 2}

    def round_events(run_dir: Path) -> list[dict]:
        events = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return [event for event in events if event["event"] == "round"]

    Simulation(config, out_dir=tmp_path / "cpu", progress=False).run()
    assert all("gpu_peak_bytes" not in event for event in round_events(tmp_path / "cpu"))  # a CPU's files as before
    monkeypatch.setattr(client_actor, "gpu_peak_bytes", lambda device: 3 * 2**20)  # as an actor on a GPU reads it
    Simulation(config, out_dir=tmp_path / "gpu", progress=False).run()
    assert [event["gpu_peak_bytes"] for event in round_events(tmp_path / "gpu")] == [3 * 2**20] * 2
    folder = tmp_path / "gpu" / "tensorboard" / "gpu" / "fedavg"  # <log_dir>/<the run folder's name>/<method>
    peaks = _accumulator(folder).Scalars("round/gpu_peak_bytes")
    assert [(event.step, event.value) for event in peaks] == [(1, 3 * 2**20), (2, 3 * 2**20)]


# MLflow ---------------------------------------------------------------------------------------------------------
def test_mlflow_file_store_holds_the_config_every_round_once_and_the_report(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracked["mlruns"].as_uri())
    ids = tracked["record"]["mlflow"]["ids"]
    experiment = client.get_experiment_by_name("tiny")  # the config's name
    runs = {run.info.run_id: run for run in client.search_runs([experiment.experiment_id])}
    assert set(runs) == set(ids.values())
    parent, ditto = runs[ids[""]], runs[ids["ditto"]]
    assert parent.info.run_name == "run" and ditto.info.run_name == "ditto"
    assert {run.info.status for run in runs.values()} == {"FINISHED"}
    assert ditto.data.tags["mlflow.parentRunId"] == parent.info.run_id and ditto.data.tags["team"] == "fl"
    assert ditto.data.params["train.lr"] == "0.01" and ditto.data.params["method.params.lam"] == "0.3"
    assert parent.data.params["methods.1.name"] == "ditto"
    history = client.get_metric_history(ditto.info.run_id, "eval/local_acc")
    assert [metric.step for metric in history] == list(range(1, ROUNDS + 1))
    assert [metric.value for metric in history] == pytest.approx(list(_eval_means(tracked["events"], "ditto").values()))
    up_bytes = client.get_metric_history(ditto.info.run_id, "round/up_bytes")
    assert [metric.step for metric in up_bytes] == list(range(1, ROUNDS + 1))
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    assert {"summary.json", "report.md", "report"} <= artifacts
    figures = {item.path for item in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/curves.png", "report/clients.png"} <= figures


# What a tracker logs ---------------------------------------------------------------------------------------------
def test_an_evaluation_logs_mean_and_spread_over_clients_and_per_client_values_behind_the_switch():
    event = {"event": "eval", "method": "m", "round": 2, "local_acc": 0.5, "num_train": 3,
             "clients": {"0": {"local_acc": 0.25, "num_train": 8}, "1": {"local_acc": 0.75, "num_train": 9}}}
    assert event_values(event, per_client=False) == {"eval/local_acc": 0.5, "eval_std/local_acc": 0.25}
    assert event_values(event, per_client=True) == {"eval/local_acc": 0.5, "eval_std/local_acc": 0.25,
                                                    "client/0/local_acc": 0.25, "client/1/local_acc": 0.75}
    round_event = {"event": "round", "method": "m", "round": 2, "clients": [0, 1, 2], "participants": [0, 1],
                   "dropped": [2], "late": [], "up_bytes": 10, "wall_s": 0.5, "train_loss": None,
                   "actor_busy_s": [0.1], "gpu_peak_bytes": 2048}
    assert event_values(round_event, per_client=True) == {
        "round/up_bytes": 10, "round/wall_s": 0.5, "round/gpu_peak_bytes": 2048, "round/participants": 2,
        "round/dropped": 1, "round/late": 0}


# Failures --------------------------------------------------------------------------------------------------------
def test_an_unreachable_tracker_is_said_once_and_the_run_goes_on_and_wandb_falls_back_offline(
        tmp_path, wandb_home, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    config = {**copy.deepcopy(CONFIG), "methods": ["fedavg"],
              "tracking": {"wandb": True, "mlflow": {"tracking_uri": "http://127.0.0.1:9"}}}
    config["federation"]["rounds"] = 2
    summary = Simulation(config, out_dir=tmp_path / "run", progress=False).run()
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[rayfed] tracking.")]
    assert len(said) == 2, said
    assert said[0].startswith("[rayfed] tracking.wandb: W&B cannot be reached (UsageError: ")
    assert said[0].endswith(f"upload them later with: wandb sync {tmp_path / 'run' / 'wandb'}/offline-run-*")
    assert said[1].startswith("[rayfed] tracking.mlflow: opening its run failed (")
    assert said[1].endswith("; the run goes on without it.")
    assert summary["methods"]["fedavg"]["mean"]["local_acc"] > 0 and (tmp_path / "run" / "report.md").is_file()
    runs = _wandb_runs(tmp_path / "run")
    assert sorted(run["name"] for run in runs.values()) == ["fedavg", "run"]  # both written offline
    record = json.loads((tmp_path / "run" / RECORD_FILE).read_text())
    assert set(record["wandb"]["ids"]) == {"", "fedavg"} and record["mlflow"] == {"ids": {}, "logged": {}}


def test_a_tracker_asked_for_but_not_installed_is_refused_in_one_sentence(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    config = {**copy.deepcopy(CONFIG), "tracking": {"mlflow": True}}
    with pytest.raises(ConfigError, match=r"^tracking\.mlflow needs the mlflow package, which is not installed; pip "
                                          r"install 'rayfed\[mlflow\]', or leave tracking\.mlflow unset\.$"):
        Simulation(config, progress=False)


def test_a_failing_tracker_is_said_once_and_left_out(tmp_path):
    said = []
    config = load_config({**copy.deepcopy(CONFIG), "tracking": {"tensorboard": {"log_dir": str(tmp_path / "tb")}}})
    tracking = RunTracking(config, tmp_path, say=said.append)
    tracking.trackers["tensorboard"].log = lambda *args: 1 / 0
    for round_done in (1, 2):
        tracking({"event": "round", "method": "fedavg", "round": round_done, "wall_s": 0.1})
    tracking.finish([])
    assert said == ["[rayfed] tracking.tensorboard: logging fedavg's round 1 failed (ZeroDivisionError: division by "
                    "zero); the run goes on without it."]
    assert tracking.trackers == {}


# The config section ----------------------------------------------------------------------------------------------
def test_the_tracking_section_from_yaml_overrides_and_python():
    on = load_config(CONFIG, ["tracking.wandb=true", "tracking.mlflow.experiment=e", "tracking.tensorboard=false"])
    assert on.tracking.trackers == ["wandb", "mlflow"] and on.tracking.wandb.mode == "online"
    assert on.tracking.mlflow.experiment == "e" and load_config(on).tracking == on.tracking
    with pytest.raises(ConfigError, match=r"^unknown config field 'tracking.wandb.projet' \(did you mean 'project'"):
        load_config(CONFIG, ["tracking.wandb.projet=x"])
    with pytest.raises(ConfigError, match=r"^tracking.wandb.mode = 'cloud' is invalid: Input should be 'online' or "):
        load_config(CONFIG, ["tracking.wandb.mode=cloud"])
    off = load_config(CONFIG)
    assert "tracking" not in off.to_dict() and "tracking" in on.to_dict()
    assert config_fingerprint(on.to_dict()) == config_fingerprint(off.to_dict())  # a resumed run may add trackers


_UNTRACKED = """
import json, sys
from rayfed.simulation import Simulation
summary = Simulation(json.loads(sys.argv[1]), out_dir=sys.argv[2], progress=False).run()
packages = set(json.loads(sys.argv[3]))
imported = sorted(name for name in sys.modules if name.split(".")[0] in packages or name.startswith("rayfed.tracking"))
print(json.dumps({"methods": summary["methods"], "imported": imported}))
"""


def test_without_a_tracker_nothing_is_imported_or_recorded_and_the_numbers_are_the_tracked_runs(tracked, tmp_path):
    untracked = tmp_path / "untracked"
    done = subprocess.run([sys.executable, "-c", _UNTRACKED, json.dumps(CONFIG), str(untracked),
                           json.dumps(TRACKING_PACKAGES)], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["imported"] == []
    assert result["methods"] == tracked["summary"]["methods"]  # tracking, interrupted and resumed, changed no number
    assert not (untracked / RECORD_FILE).exists() and not (untracked / "tensorboard").exists()
    assert "tracking" not in yaml.safe_load((untracked / "config.yaml").read_text())
    assert "tracking" not in json.loads((untracked / "summary.json").read_text())["config"]


# A sweep ----------------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("ray_local")
def test_a_sweeps_trials_are_tracked_runs_grouped_by_the_sweep_with_their_sampled_values(tmp_path, wandb_home):
    from mlflow.tracking import MlflowClient
    from tensorboard.plugins.hparams import plugin_data_pb2

    from rayfed.tune import tune

    config = copy.deepcopy(CONFIG)
    config["methods"] = ["fedavg"]
    config["federation"].update(rounds=2, checkpoint_every=0)
    config["tune"] = {"metric": "fedavg/local_acc", "search": "grid", "space": {"train.lr": {"grid": [0.02, 0.01]}}}
    config["tracking"] = {"tensorboard": True, "wandb": {"mode": "offline"},
                          "mlflow": {"tracking_uri": (tmp_path / "mlruns").as_uri()}}
    result = tune(config, out_dir=tmp_path / "sweep", verbose=0)
    trials = {trial.trial_id: trial.params["train.lr"] for trial in result.trials}
    assert sorted(trials.values()) == [0.01, 0.02]

    runs = _wandb_runs(result.tune_dir)
    assert {run["group"] for run in runs.values()} == {"sweep"}  # the sweep's folder name
    [sweep_run] = [run for run in runs.values() if run["job_type"] == "sweep"]
    assert {"trials.csv", "best.yaml"} <= set(sweep_run["files"])
    trial_runs = {run["config"]["trial_id"]: run for run in runs.values() if run["job_type"] == "trial"}
    assert {trial_id: run["config"]["train.lr"] for trial_id, run in trial_runs.items()} == trials
    assert all(any("fedavg/local_acc" in row for row in run["history"]) for run in trial_runs.values())

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    [parent] = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    assert parent.info.run_name == "sweep" and parent.info.status == "FINISHED"
    assert {"trials.csv", "trials.md", "best.yaml"} <= {item.path for item in client.list_artifacts(parent.info.run_id)}
    figures = [item.path for item in client.list_artifacts(parent.info.run_id, "report")]
    assert figures == ["report/metric_vs_params.png"]
    children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(float(run.data.params["train.lr"]) for run in children) == [0.01, 0.02] and len(runs) == 3

    for trial_id, lr in trials.items():
        accumulator = _accumulator(result.tune_dir / "experiment" / trial_id)
        content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        assert hparams["train.lr"].number_value == pytest.approx(lr)
