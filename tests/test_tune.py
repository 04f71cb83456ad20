"""Ray Tune sweeps: the tune: section's checks, ASHA on per-round evaluations, trial placement groups, resume."""

from __future__ import annotations

import copy
import csv
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import yaml
from conftest import TINY_RUN, ray_paused
from ray import cloudpickle

from rayfed.cli import main
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.simulation import Simulation, init_local_ray
from rayfed.simulation import gpu_memory
from rayfed.simulation.gpu_memory import Measurement
from rayfed.simulation.placement import fitted_slots
from rayfed.tune import SearchSpace, TuneSpec, trial_resources, tune
from rayfed.tune.metric import _Reporter

# The callbacks below run inside Tune's trial processes, which cannot import this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BAD_LR = 1e-7


def _sweep(space: dict, **tune_fields) -> dict:
    """TINY_RUN with one evaluation and checkpoint per round, one ClientActor, and a tune: section."""
    config = copy.deepcopy(TINY_RUN)
    config["federation"].update(rounds=4, eval_every=1, checkpoint_every=1)
    config["placement"] = {"clients_per_actor": 4, "cpus_per_actor": 0.5}
    config["tune"] = {"metric": "fedavg/local_acc", "space": space, "max_concurrent_trials": 2, **tune_fields}
    return config


@pytest.fixture(scope="module")
def ray_fake_gpu():
    """Local Ray with one fake GPU, for this module; a Ray another module started is paused meanwhile."""
    with ray_paused():
        init_local_ray(num_cpus=4, num_gpus=1, object_store_memory=5 * 10**8)
        yield


def _read_table(tune_dir) -> list[dict]:
    with (tune_dir / "trials.csv").open() as handle:
        return list(csv.DictReader(handle))


# The tune: section, checked before anything starts -----------------------------------------------
@pytest.mark.parametrize(("change", "message"), [
    ({"tune": None}, "rayfed tune needs a `tune:` section"),
    ({"space": {"train.lrr": {"choice": [0.1]}}},
     "tune.space.train.lrr = 0.1 does not fit the config: unknown config field 'train.lrr' (did you mean 'lr'?)"),
    ({"space": {"train.lr": {"unifrom": [0.1, 1]}}},
     "tune.space.train.lr = 'unifrom' is not known (did you mean 'uniform'?)"),
    ({"space": {"train.lr": {"loguniform": [0, 1]}}}, "tune.space.train.lr.loguniform = [0, 1] needs low > 0"),
    ({"space": {"train.lr": {"uniform": [1, 0.1]}}}, "tune.space.train.lr.uniform = [1, 0.1] needs low < high"),
    ({"space": {"train.lr": 0.1}}, "tune.space.train.lr = 0.1 is not a search space"),
    ({"space": {"train.lr": {"choice": []}}}, "tune.space.train.lr.choice = [] must be a non-empty list"),
    ({"space": {"train.local_steps": {"uniform": [2, 9]}}},
     "tune.space.train.local_steps = 5.5 does not fit the config: train.local_steps = 5.5 is invalid"),
    ({"space": {"methods.0.lam": {"uniform": [0.1, 1]}}}, "methods[0] (fedavg) has no hyperparameter 'lam'"),
    ({"space": {"model.lora.targets": [{"choice": []}, "v_proj"]}},
     "tune.space.model.lora.targets[0].choice = [] must be a non-empty list"),
    ({"space": {"model.lora.targets": ["q_proj", "v_proj"]}}, "holds no search space"),
    ({"space": {"ray.num_cpus": {"choice": [1, 2]}}}, "tune.space.ray.num_cpus: the ray section cannot be swept"),
    ({"space": {"federation.clients_per_round": {"choice": [2, 9]}}},
     "tune.space.federation.clients_per_round = 9 does not fit the config: federation.clients_per_round = 9 is larger"),
    ({"metric": "fedavgg/local_acc"},
     "tune.metric = 'fedavgg/local_acc' names no method of the config (did you mean 'fedavg'?)"),
    ({"metric": "local_acc"}, "tune.metric = 'local_acc' must name a method and a metric as LABEL/METRIC"),
    ({"metric": "fedavg/local_accuracy"},
     "tune.metric = 'fedavg/local_accuracy': no run reports a metric 'local_accuracy' (did you mean 'local_acc'?)"),
    ({"metric": "fedavg/accuracy@personal"}, "no run reports a metric 'accuracy'"),
    ({"mode": "maximum"}, "tune.mode = 'maximum' is invalid: Input should be 'max' or 'min'"),
    ({"searchh": "grid"}, "unknown tune field 'tune.searchh' (did you mean 'search'?)"),
    ({"search": "grid"}, "tune.space.train.lr is loguniform, which grid search cannot enumerate"),
    ({"scheduler": {"name": "asha", "grace_period": 5}}, "tune.scheduler.grace_period = 5 is more than the 4 rounds"),
    ({"scheduler": {"name": "fifo", "grace_period": 2}},
     "tune.scheduler.grace_period applies to the asha scheduler only"),
    ({"scheduler": "hyperband"}, "tune.scheduler.name = 'hyperband' is invalid: Input should be 'fifo' or 'asha'"),
])
def test_bad_tune_section_is_one_sentence_naming_the_path(change, message, tmp_path):
    config = _sweep({"train.lr": {"loguniform": [1e-3, 1e-1]}})
    if "tune" in change:
        config["tune"] = change["tune"]
    else:
        config["tune"].update(change)
    with pytest.raises(ConfigError) as err:
        tune(config, out_dir=tmp_path, verbose=0)
    assert str(err.value).startswith(message) or message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "tune").exists()  # nothing was launched


def test_optuna_search_without_optuna_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if it were not installed
    config = _sweep({"train.lr": {"loguniform": [1e-3, 1e-1]}}, search="optuna")
    with pytest.raises(ConfigError, match=r"tune.search = 'optuna' needs the optuna package \(pip install optuna\)"):
        tune(config, out_dir=tmp_path)


def test_cli_prints_a_bad_sweep_as_one_line(tmp_path, capsys):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(_sweep({"train.lr": {"grid": [0.1, -1.0]}})))
    assert main(["tune", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "rayfed: error: tune.space.train.lr = -1.0 does not fit the config: train.lr = -1.0 is invalid")
    assert "\n" not in err
    assert main(["tune", "--resume", str(tmp_path)]) == 2
    assert "no tune/sweep.yaml with Ray Tune state there, so it is not a rayfed sweep" in capsys.readouterr().err


def test_per_task_vectors_and_whole_vector_choices_decode_to_config_values():
    vectors = [["q_proj", "v_proj"], ["q_proj"]]
    space = SearchSpace({
        "model.lora.targets": [{"choice": ["q_proj", "k_proj"]}, "v_proj"],  # element 0 searched, element 1 fixed
        "data.partition.alpha": {"loguniform": [0.1, 10.0]},
        "system.speeds": {"grid": [{0: 1.0}, {0: 2.0}]},
    }, search="random")
    params = space.param_space()
    assert set(params) == {"model.lora.targets.0", "data.partition.alpha", "system.speeds"}
    assert params["system.speeds"] == {"grid_search": [0, 1]}  # mappings travel as indices
    values = space.values({"model.lora.targets.0": "k_proj", "data.partition.alpha": 0.5, "system.speeds": 1})
    assert values == {"model.lora.targets": ["k_proj", "v_proj"], "data.partition.alpha": 0.5,
                      "system.speeds": {0: 2.0}}

    whole = SearchSpace({"model.lora.targets": {"choice": vectors}}, search="grid")
    assert whole.param_space() == {"model.lora.targets": {"grid_search": [0, 1]}}
    assert whole.values({"model.lora.targets": 1}) == {"model.lora.targets": ["q_proj"]}


def test_a_metric_the_method_does_not_report_names_the_ones_it_does():
    spec = TuneSpec(metric="fedavg/local_accuracy", space={"train.lr": {"choice": [0.1]}})
    evaluation = {"event": "eval", "method": "fedavg", "round": 2, "local_acc": 0.5, "local_loss": 1.2, "clients": {}}
    simulation = SimpleNamespace(log=SimpleNamespace(events=[evaluation]))
    with pytest.raises(ConfigError, match=r"^tune.metric = 'fedavg/local_accuracy': method 'fedavg' reports no "
                                          r"'local_accuracy' \(did you mean 'local_acc'\?\); "
                                          r"it reports local_acc, local_loss.$"):
        _Reporter(spec)(simulation, "fedavg", 2)


def test_the_metric_names_runs_report_pass_the_check_before_trials():
    from rayfed.tasks.kinds import Classification
    from rayfed.tune.metric import _check_metric_name

    class Agreement(Classification):
        metrics = ("agreement",)

    config = load_config({**TINY_RUN, "data": {**TINY_RUN["data"], "kind": Agreement}})
    for metric in ("local_acc", "novel_acc", "others_token_f1", "hm", "rep_shift", "local_acc@personal",
                   "local_agreement"):  # the last: the config's own task kind's
        _check_metric_name(TuneSpec(metric=f"fedavg/{metric}", space={"train.lr": {"choice": [0.1]}}), config)
    for path in sorted((Path(__file__).parents[1] / "configs" / "tune").glob("*.yaml")):
        shipped = load_config(path)
        _check_metric_name(TuneSpec.model_validate(shipped.tune), shipped)


def test_a_trial_that_reported_nothing_is_listed_with_the_values_ray_wrote_for_it(tmp_path):
    """A sweep's time budget can stop a trial before its first report, or before it starts: its result then has no
    config. The trial table lists it (from Ray's params.json when there is one) instead of failing the whole sweep."""
    from rayfed.tune.tables import _record

    space = SearchSpace({"train.lr": {"grid": [0.1, 0.01]}}, search="grid")
    sweep = SimpleNamespace(space=space, spec=SimpleNamespace(metric="local_acc"), runs_dir=tmp_path / "runs")
    started, never_started = tmp_path / "trial_00001", tmp_path / "trial_00002"
    started.mkdir()
    (started / "params.json").write_text(json.dumps({"train.lr": 0.01}))
    for trial_dir, params in ((started, {"train.lr": 0.01}), (never_started, {})):
        record = _record(sweep, SimpleNamespace(metrics={}, config=None, error=None, path=str(trial_dir)))
        assert (record.params, record.status, record.metric, record.rounds) == (params, "stopped early", None, 0)


def test_best_yaml_records_every_hyperparameter_of_the_best_trial_defaults_included(tmp_path):
    """Not only the swept and the set values: every field of each method's Params, as the best trial built it."""
    from rayfed.tune.runner import _finish
    from rayfed.tune.sweep import _Sweep

    config = _sweep({"methods.0.lam": {"grid": [0.5, 2.0]}}, metric="ditto/local_acc")
    config["methods"] = [{"name": "ditto", "personal_steps": 2}, "fedprox"]
    sweep = _Sweep.build(load_config(config), tmp_path, None)
    [key] = sweep.space.param_space()
    grid = [SimpleNamespace(metrics={"ditto/local_acc": acc, "final": True, "round": 4}, config={key: lam}, error=None,
                            path=str(tmp_path / f"trial_{lam}")) for lam, acc in ((0.5, 0.4), (2.0, 0.7))]
    best = yaml.safe_load(_finish(sweep, tmp_path, grid).best_config.read_text())
    assert [entry["params"] for entry in best["methods"]] == [{"lam": 2.0, "personal_steps": 2}, {"mu": 0.01}]
    assert best["tune"] is None and best["federation"]["rounds"] == 4
    rebuilt = load_config(best)
    assert rebuilt.methods[0].params == {"lam": 2.0, "personal_steps": 2}


def test_trial_resources_has_the_driver_bundle_then_one_bundle_per_client_actor(tiny_run):
    tiny_run["placement"] = {"clients_per_actor": 3, "cpus_per_actor": 2, "gpus_per_actor": 0.25,
                             "driver_cpus": 1, "strategy": "SPREAD"}
    tiny_run["data"]["num_clients"] = 7
    resources = trial_resources(load_config(tiny_run))
    assert resources.head_bundle_is_empty  # the trial function runs in bundle 0 without a reservation of its own
    assert resources.bundles == [{"CPU": 1.0}] + [{"CPU": 2.0, "GPU": 0.25}] * 3
    assert resources.strategy == "SPREAD"


def test_a_local_trial_reserves_one_bundle_for_its_process_as_large_as_its_largest_actor(tiny_run):
    tiny_run["placement"] = {"executor": "local", "clients_per_actor": 3, "cpus_per_actor": 2, "gpus_per_actor": 0.25}
    tiny_run["data"]["num_clients"] = 7
    resources = trial_resources(load_config(tiny_run))
    assert resources.bundles == [{"CPU": 2.0, "GPU": 0.25}]
    assert not resources.head_bundle_is_empty  # the trial function itself runs every actor

    tiny_run["placement"] = {"executor": "local", "cpus_per_actor": 0.5}
    assert trial_resources(load_config(tiny_run)).bundles == [{"CPU": 0.5}]


# Sweeps on Ray -----------------------------------------------------------------------------------
class _RecordPlacement:
    """Per round, from inside the trial: its placement group, and each actor's placement group and resources."""

    def __init__(self, folder):
        self.folder = folder

    def __call__(self, sim, label, rounds_done):
        group = ray.util.get_current_placement_group()
        placed = ray.get([actor.__ray_call__.remote(_placement_of) for actor in [sim.driver, *sim.actors]])
        created = {pg_id: [bundle for _, bundle in sorted(info["bundles"].items())]
                   for pg_id, info in ray.util.placement_group_table().items() if info["state"] == "CREATED"}
        trial_id = ray.tune.get_context().get_trial_id()
        (self.folder / f"{trial_id}-{rounds_done}.json").write_text(json.dumps({
            "group": group.id.hex(), "bundles": group.bundle_specs, "actors": placed, "created": created,
        }))


def _placement_of(_actor) -> list:
    context = ray.get_runtime_context()
    return [context.get_placement_group_id(), context.get_assigned_resources()]


@pytest.fixture(scope="module")
def asha_sweep(ray_fake_gpu, tmp_path_factory) -> dict:
    """One ASHA sweep of 3 trials, 2 at a time, each with 2 ClientActors on 0.25 of the one (fake) GPU: the bad
    trial starts once a good one has finished, and meets both good ones' round-1 results at ASHA's first rung."""
    folder = tmp_path_factory.mktemp("asha")
    config = _sweep({"train.lr": {"grid": [0.02, 0.01, BAD_LR]}},
                    scheduler={"name": "asha", "grace_period": 1, "reduction_factor": 2})
    config["placement"] = {"clients_per_actor": 2, "cpus_per_actor": 0.5, "gpus_per_actor": 0.25}
    (folder / "placement").mkdir()
    result = tune(config, out_dir=folder / "out", callbacks=[_RecordPlacement(folder / "placement")], verbose=0)
    return {"result": result, "folder": folder}


def test_asha_stops_a_bad_trial_and_the_best_yaml_reproduces_its_metric(asha_sweep, capsys):
    tune_dir = asha_sweep["result"].tune_dir
    rows = _read_table(tune_dir)
    assert len(rows) == 3
    assert set(rows[0]) == {"trial", "train.lr", "fedavg/local_acc", "round", "status"}
    bad = [row for row in rows if float(row["train.lr"]) == BAD_LR]
    assert any(row["status"] == "stopped early" and int(row["round"]) < 4 for row in bad)
    best = rows[0]  # best first
    assert best["status"] == "completed" and float(best["train.lr"]) != BAD_LR and best["round"] == "4"
    completed = [float(row["fedavg/local_acc"]) for row in rows if row["status"] == "completed"]
    assert float(best["fedavg/local_acc"]) == max(completed)
    markdown = (tune_dir / "trials.md").read_text()
    assert "stopped early" in markdown and "best.yaml" in markdown
    assert (tune_dir / "metric_vs_params.png").stat().st_size > 1000

    best_yaml = yaml.safe_load((tune_dir / "best.yaml").read_text())
    assert best_yaml["tune"] is None and best_yaml["train"]["lr"] == float(best["train.lr"])
    rerun = asha_sweep["folder"] / "rerun"
    # in this process (executor local): the trial's numbers, which it made on Ray actors
    assert main(["run", str(tune_dir / "best.yaml"), "placement.executor=local", "--out", str(rerun), "--quiet"]) == 0
    summary = json.loads((rerun / "summary.json").read_text())
    assert summary["methods"]["fedavg"]["mean"]["local_acc"] == float(best["fedavg/local_acc"])


def test_concurrent_trials_keep_their_actors_inside_their_own_placement_group(asha_sweep):
    client_bundle = {"CPU": 0.5, "GPU": 0.25}
    paths = sorted((asha_sweep["folder"] / "placement").iterdir())
    assert {path.name.rsplit("-", 1)[0] for path in paths} == {t.trial_id for t in asha_sweep["result"].trials}
    records = [json.loads(path.read_text()) for path in paths]
    for record in records:
        assert record["bundles"] == [{"CPU": 0.25}, client_bundle, client_bundle]
        (driver_group, driver_resources), *clients = record["actors"]
        assert driver_group == record["group"] and driver_resources == {}
        assert clients == [[record["group"], client_bundle]] * 2
        assert sum(b.get("GPU", 0.0) for bundles in record["created"].values() for b in bundles) <= 1.0
    trial_groups = {record["group"] for record in records}
    assert any(len(trial_groups & set(record["created"])) == 2 for record in records)  # 2 trials at once


@pytest.mark.usefixtures("ray_fake_gpu")
def test_a_measured_sweep_measures_once_and_every_trial_asks_for_the_measured_share(tmp_path, monkeypatch):
    probed = []

    def probe(config, name, slot):  # (22 + 2 GiB of headroom) / 80: 0.3 of the (fake) GPU
        probed.append(slot)
        return Measurement(slot, 22 * 2**30, "Fake GPU", 80 * 2**30)

    monkeypatch.setattr(gpu_memory, "probe_on_gpu", probe)
    config = _sweep({"train.lr": {"grid": [0.02, 0.01]}})  # a float: the same memory, one probe for both trials
    config["federation"].update(rounds=1, checkpoint_every=0)
    config["placement"]["gpus_per_actor"] = "measured"
    (tmp_path / "placement").mkdir()
    result = tune(config, out_dir=tmp_path / "out", callbacks=[_RecordPlacement(tmp_path / "placement")], verbose=0)
    assert probed == [(0, 1, 2, 3)] and len(result.trials) == 2
    assert len(json.loads((result.tune_dir / "gpu_memory.json").read_text())) == 1
    for record in [json.loads(path.read_text()) for path in (tmp_path / "placement").iterdir()]:
        assert record["bundles"] == [{"CPU": 0.25}, {"CPU": 0.5, "GPU": 0.3}]
        assert record["actors"][1] == [record["group"], {"CPU": 0.5, "GPU": 0.3}]
    for trial in result.trials:
        summary = json.loads((trial.run_dir / "summary.json").read_text())
        assert summary["gpu_memory"] == {"": {"gpus_per_actor": 0.3, "from": "the trial's placement group"}}


@pytest.mark.usefixtures("ray_fake_gpu")
def test_a_measured_run_records_its_share_and_resumed_reads_the_measurement_back(tiny_run, tmp_path, monkeypatch):
    probed = []

    def probe(config, name, slot):  # (6 + 2 GiB of headroom) / 80: 0.1 of the (fake) GPU
        probed.append(slot)
        return Measurement(slot, 6 * 2**30, "Fake GPU", 80 * 2**30)

    monkeypatch.setattr(gpu_memory, "probe_on_gpu", probe)
    tiny_run["federation"].update(rounds=1)
    tiny_run["placement"]["gpus_per_actor"] = "measured"
    summary = Simulation(tiny_run, out_dir=tmp_path, progress=False).run()
    record = summary["gpu_memory"][""]
    assert (record["gpus_per_actor"], record["actor_clients"], record["peak_gib"]) == (0.1, [0, 1], 6.0)
    assert probed == [(0, 1)] and (tmp_path / "gpu_memory.json").is_file()
    assert Simulation.resume(tmp_path, progress=False).run()["gpu_memory"] == summary["gpu_memory"]
    assert len(probed) == 1


@pytest.mark.usefixtures("ray_fake_gpu")
def test_a_trial_larger_than_the_cluster_is_refused_before_launching(tmp_path):
    config = _sweep({"train.lr": {"choice": [0.01]}})
    config["placement"] = {"clients_per_actor": 1, "cpus_per_actor": 0.5, "gpus_per_actor": 0.5}  # 4 actors: 2 GPUs
    with pytest.raises(ConfigError, match=r"^placement: one trial's placement group needs 2 GPU .* the Ray cluster "
                                          r"has 1; raise placement.clients_per_actor or lower placement.gpus_\w+"):
        tune(config, out_dir=tmp_path, verbose=0)
    assert not (tmp_path / "tune").exists()


@pytest.mark.usefixtures("ray_fake_gpu")
def test_a_trial_whose_gpu_shares_fit_in_sum_but_not_one_to_a_gpu_is_refused_before_launching(tmp_path, monkeypatch):
    import ray

    config = _sweep({"train.lr": {"choice": [0.01]}})
    config["placement"] = {"clients_per_actor": 1, "cpus_per_actor": 0.5, "gpus_per_actor": 0.6}  # 4 actors: 2.4 GPU
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 3.0})
    with pytest.raises(ConfigError, match=r"^placement: 4 ClientActors of one trial x 0\.6 GPU take 4 GPUs, as Ray "
                                          r"gives a share below 1 a place on one GPU, but the Ray cluster has 3; "
                                          r"lower placement\.gpus_per_actor \(to 0\.5 here\) or raise "
                                          r"placement\.clients_per_actor\.$"):
        tune(config, out_dir=tmp_path, verbose=0)
    assert not (tmp_path / "tune").exists()


class _FailAt:
    """Raise after the engine has written round ``at``'s checkpoint."""

    def __init__(self, at: int):
        self.at = at

    def __call__(self, sim, label, rounds_done):
        if rounds_done == self.at:
            raise RuntimeError("injected failure")


@pytest.mark.usefixtures("ray_fake_gpu")
def test_resumed_sweep_continues_a_failed_trial_from_its_checkpoint(tmp_path, capsys):
    config = _sweep({"train.lr": {"choice": [0.02]}})
    config["placement"]["executor"] = "local"  # the trial's process runs its actors: resume is the same on Ray
    out = tmp_path / "out"

    with pytest.raises(RuntimeError, match="no trial of the sweep completed .1 errored.*first error: injected failure"):
        tune(config, out_dir=out, callbacks=[_FailAt(2)], verbose=0)
    [failed] = _read_table(out / "tune")
    assert failed["status"] == "error" and failed["round"] == "1"  # it failed before reporting round 2
    run_dir = out / "tune" / "runs" / failed["trial"]
    assert json.loads((run_dir / "checkpoints" / "fedavg" / "latest.json").read_text())["round"] == 2

    assert main(["tune", "--resume", str(out)]) == 0
    assert "trials: 1 completed, 0 stopped early, 0 errored" in capsys.readouterr().out
    [resumed] = _read_table(out / "tune")
    assert (resumed["trial"], resumed["status"], resumed["round"]) == (failed["trial"], "completed", "4")
    reported = (out / "tune" / "experiment" / failed["trial"] / "result.json").read_text().splitlines()
    assert [json.loads(line)["round"] for line in reported] == [1, 3, 4]  # 3 and 4 from the round-2 checkpoint
    summary = json.loads((run_dir / "summary.json").read_text())
    assert float(resumed["fedavg/local_acc"]) == summary["methods"]["fedavg"]["mean"]["local_acc"]
    with pytest.raises(ConfigError, match="already holds a sweep; pass --resume"):
        tune(config, out_dir=out)


def test_simulation_in_a_too_small_placement_group_says_which_bundle(tiny_run, tmp_path, monkeypatch):
    trial_group = SimpleNamespace(bundle_specs=[{"CPU": 0.25}, {"CPU": 0.25}, {"CPU": 0.5}])
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: trial_group)
    simulation = Simulation(tiny_run, out_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match=r"^placement: ClientActor 0 needs \{'CPU': 0.5, 'GPU': 0.0\} but bundle 1 "
                                          r"of the trial's placement group holds \{'CPU': 0.25\}"):
        fitted_slots(simulation.config)
    trial_group.bundle_specs = trial_group.bundle_specs[:2]
    with pytest.raises(ConfigError, match="need 3 bundles but the trial's placement group has 2"):
        fitted_slots(simulation.config)


def test_a_swept_hyperparameter_reaches_the_methods_params_and_a_bad_one_is_named_with_its_range(tmp_path):
    from rayfed.method import build_method
    from rayfed.methods import DittoParams
    from rayfed.tune.sweep import _trial_config

    config = _sweep({"methods.0.lam": {"choice": [0.25, -1.0]}}, metric="ditto/local_acc")
    config["methods"] = [{"name": "ditto", "personal_steps": 2}]
    trial = _trial_config(config, {"methods.0.lam": 0.25})
    assert build_method(trial.methods[0], 0).params == DittoParams(lam=0.25, personal_steps=2)
    with pytest.raises(ConfigError) as err:
        tune(config, out_dir=tmp_path, verbose=0)
    assert str(err.value) == ("tune.space.methods.0.lam = -1.0 does not fit the config: methods[0] (ditto).lam = -1.0 "
                              "is invalid: must be >= 0.")
    assert not (tmp_path / "tune").exists()
