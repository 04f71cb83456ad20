"""benchmarks/papers/offline_runs.py: every plan's job is one existing method of a valid config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offline_runs import plans

from rayfed.config import build_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PLANS = plans(CONFIGS)


def job_config(stem: str, label: str, overrides: dict, seed: int, extra: dict) -> dict:
    from offline_runs import job_config

    return job_config(CONFIGS, stem, label, overrides, seed, extra)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_every_plan_entry_builds_one_method_of_a_valid_config(plan: str) -> None:
    for stem, label, overrides in PLANS[plan]:
        config = build_config(job_config(stem, label, overrides, seed=3, extra={}))
        assert [entry.label for entry in config.methods] == [label]
        assert config.seed == 3 and config.placement.executor == "local"


def test_a_label_the_config_lacks_is_named_in_the_error() -> None:
    with pytest.raises(ValueError, match="no method labelled 'nope'"):
        job_config("feddat/offline_domain", "nope", {}, seed=0, extra={})


def test_overrides_reach_nested_method_fields() -> None:
    config = job_config("fedmosaic/offline_dynamic", "fedmosaic", {"methods.0.tau": 2.0}, seed=0,
                        extra={"federation.rounds": 2})
    assert config["methods"][0]["tau"] == 2.0 and config["federation"]["rounds"] == 2


def test_others_are_grouped_by_the_other_tasks_group_and_architecture() -> None:
    from fedmosaic_others import by_relation

    def task(name: str, client: int, group: int) -> dict:
        return {"name": name, "clients": [client], "options": {"group": group}}

    config = {"data": {"tasks": [task("a", 0, 0), task("b", 1, 0), task("c", 2, 1), task("d", 3, 1)]},
              "architectures": {"small": {"clients": [0, 2]}, "large": {"clients": [1, 3]}}}
    clients = {"0": {"others/b_f1": 0.8, "others/c_f1": 0.2, "others/d_f1": 0.1, "others_f1": 0.37, "self_f1": 1.0},
               "1": {"others/a_f1": 0.6, "others/c_f1": 0.4, "others/d_f1": 0.3}}
    assert by_relation(clients, config, "f1") == pytest.approx({
        "same group, other architecture": 0.7,  # 0 on b, 1 on a
        "other group, same architecture": (0.2 + 0.3) / 2,  # 0 on c (small), 1 on d (large)
        "other group, other architecture": (0.1 + 0.4) / 2,
    })


def test_the_settings_paired_with_offline_dynamic_differ_from_it_only_in_their_methods() -> None:
    import yaml

    from fedmosaic_tables import SAME_CLIENTS, SAME_CLIENTS_STATIC

    def without_methods(setting: str) -> dict:
        config = yaml.safe_load((CONFIGS / f"fedmosaic/offline_{setting}.yaml").read_text())
        return {key: value for key, value in config.items() if key not in ("methods", "name")}

    reference = without_methods("dynamic")
    assert [setting for setting in SAME_CLIENTS if without_methods(setting) != reference] == []
    assert without_methods("static") != reference  # the check can tell a different benchmark apart
    static = without_methods("static")
    assert [setting for setting in SAME_CLIENTS_STATIC if without_methods(setting) != static] == []


def _tables_row(setting: str, label: str, value: float = 0.3, extra: dict | None = None) -> dict:
    stream = {metric: {"a_last": value, "a_auc": value} for metric in ("self_token_f1", "others_token_f1")}
    return {"config": f"fedmosaic/offline_{setting}", "label": label, "overrides": {}, "set": extra or {}, "seed": 0,
            "stream": stream, "comm_params": {"up": 20, "down": 20}}


def test_each_settings_rows_stand_next_to_that_settings_paper_numbers() -> None:
    from fedmosaic_tables import results_table

    row = _tables_row
    lines = {line.split(" |")[0].lstrip("| "): line for line in results_table(
        [row("dynamic", "fedmosaic"), row("static", "fedmosaic"), row("alignment", "random_basis"),
         row("competitors_static", "takfl")]).splitlines()}
    assert lines["dynamic:fedmosaic"].endswith("| 67.86 / 59.83 / 51.16 / 49.36 |")  # Tab. 2
    assert lines["static:fedmosaic"].endswith("| 70.10 / 64.64 / 51.57 / 50.42 |")  # Tab. 3
    assert lines["competitors_static:takfl"].endswith("| 67.28 / 62.42 / 47.55 / 47.51 |")  # Tab. 3
    assert lines["alignment:random_basis"].endswith("|  |")  # Tab. 32 is another setting's; no column


def test_each_setting_with_its_own_sft_is_paired_with_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fedmosaic_tables import main

    more_steps = {"train.local_steps": 30}  # offline_runs --set: another setting, paired with its own SFT
    rows = [_tables_row("dynamic", "local", 0.1), _tables_row("dynamic", "fedmosaic", 0.2),
            _tables_row("async", "local", 0.4), _tables_row("async", "fedmosaic", 0.7),
            _tables_row("dynamic", "local", 0.5, more_steps), _tables_row("dynamic", "fedmosaic", 0.55, more_steps)]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    main([str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert "| dynamic:fedmosaic | 1 | 10.00 | 10.00 | 10.00 | 10.00 |" in lines
    assert "| async:fedmosaic | 1 | 30.00 | 30.00 | 30.00 | 30.00 |" in lines
    assert "| dynamic{local_steps=30}:fedmosaic | 1 | 5.00 | 5.00 | 5.00 | 5.00 |" in lines
    assert not [line for line in lines if "45.00" in line]  # never paired with the other setting's SFT


def test_the_static_competitors_pair_with_static_sft_and_not_dynamic_sft() -> None:
    from fedmosaic_tables import paired_gaps

    rows = [_tables_row("static", "local", 0.1), _tables_row("competitors_static", "takfl", 0.25),
            _tables_row("dynamic", "local", 0.5), _tables_row("competitors", "takfl", 0.55)]
    assert "| competitors_static:takfl | 1 | 15.00 | 15.00 | 15.00 | 15.00 |" in paired_gaps(rows, "local", "static")
    assert "| competitors:takfl | 1 | 5.00 | 5.00 | 5.00 | 5.00 |" in paired_gaps(rows, "local", "dynamic")


def test_a_result_line_records_the_overrides_of_offline_runs_set() -> None:
    from offline_runs import _key

    job = {"plan": "fedmosaic", "config": "fedmosaic/offline_dynamic", "label": "local", "overrides": {}, "seed": 1,
           "extra": {"train.local_steps": 30}}
    assert _key(job)["set"] == {"train.local_steps": 30}


def test_a_compute_matched_job_trains_the_steps_its_measured_cost_gives_it() -> None:
    import copy

    from conftest import TINY_RUN

    from offline_runs import compute_matched

    config = copy.deepcopy(TINY_RUN)
    config["train"]["local_steps"] = 4
    config["methods"] = ["ditto"]  # two trainings of train.local_steps steps each: twice FedAvg's FLOPs
    config["placement"] = {"executor": "local", "clients_per_actor": 2}
    matched_config, measured = compute_matched(config, "fedavg", ["fedmosaic/offline_dynamic"], CONFIGS)
    assert measured["reference"] == "fedavg" and measured["cost_ratio"] == pytest.approx(2.0, rel=0.02)
    assert measured["local_steps"] == matched_config["train"]["local_steps"] == 2
    assert config["train"]["local_steps"] == 4 and matched_config["methods"] == ["ditto"]
    with pytest.raises(ValueError, match="--compute-match nope: no config of the plans"):
        compute_matched(config, "nope", ["fedmosaic/offline_dynamic"], CONFIGS)


def test_compute_matched_rows_are_their_own_setting_with_the_papers_numbers_and_a_cost_table() -> None:
    from fedmosaic_tables import compute_matching, paired_gaps, results_table

    matched = []
    for label, value, ratio, steps in (("local", 0.1, 1.0, 10), ("fedmosaic", 0.3, 1.16, 9)):
        row = {**_tables_row("dynamic", label, value), "compute_match_reference": "local",
               "compute_match": {"reference": "local", "flops": 1.0, "cost_ratio": ratio, "local_steps": steps}}
        matched.append(row)
    baseline = {**_tables_row("baselines", "ditto", 0.2), "compute_match_reference": "local",
                "compute_match": {"reference": "local", "flops": 2.0, "cost_ratio": 2.0, "local_steps": 5}}
    rows = [*matched, baseline, _tables_row("dynamic", "local", 0.9)]
    lines = {line.split(" |")[0].lstrip("| "): line for line in results_table(rows).splitlines()}
    assert lines["dynamic{matched=local}:fedmosaic"].endswith("| 67.86 / 59.83 / 51.16 / 49.36 |")
    gaps = paired_gaps(rows, "local", "dynamic{matched=local}")
    assert "| dynamic{matched=local}:fedmosaic | 1 | 20.00 |" in gaps  # paired with the matched SFT, not 0.9's
    assert "| baselines{matched=local}:ditto | 1 | 10.00 |" in gaps
    assert compute_matching(rows).splitlines()[2:] == [
        "| baselines{matched=local}:ditto | local | 2.000 | 5 |",
        "| dynamic{matched=local}:fedmosaic | local | 1.160 | 9 |",
        "| dynamic{matched=local}:local | local | 1.000 | 10 |"]


def test_a_resumed_job_continues_from_its_checkpoint_and_a_job_without_one_starts_afresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import copy

    from conftest import TINY_RUN

    import offline_runs

    def tiny(configs, stem, label, overrides, seed, extra):
        config = copy.deepcopy(TINY_RUN)
        config.update(seed=seed, placement={"executor": "local", "clients_per_actor": 2})
        return config

    monkeypatch.setattr(offline_runs, "job_config", tiny)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU job hides the GPUs: undone after the test
    job = {"plan": "p", "configs": str(CONFIGS), "config": "c", "label": "fedavg", "overrides": {}, "seed": 3,
           "extra": {}, "device": "cpu", "threads": 1, "compute_match": None, "stems": [], "checkpoint_every": 3,
           "resume": False}
    first = offline_runs.run_job({**job, "run_dir": str(tmp_path / "first")})
    assert "error" not in first, first.get("error")
    interrupted = tmp_path / "interrupted"
    offline_runs.run_job({**job, "run_dir": str(interrupted)})
    kept = sorted(path.name for path in (interrupted / "checkpoints" / "fedavg").iterdir() if path.is_dir())
    assert kept == ["round_3"]  # checkpoint_every: as if the job had stopped in round 4
    resumed = offline_runs.run_job({**job, "run_dir": str(interrupted), "resume": True})
    assert resumed["mean"] == first["mean"] and resumed["curves"][-1] == first["curves"][-1]
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "metrics.jsonl").write_text("")  # stopped before any checkpoint: starts afresh
    assert offline_runs.run_job({**job, "run_dir": str(stale), "resume": True})["mean"] == first["mean"]


def test_configs_outside_the_plans_are_refused_naming_the_plans_configs(capsys, tmp_path) -> None:
    from offline_runs import main

    with pytest.raises(SystemExit):
        main(["--repo", str(CONFIGS.parent), "--plan", "fedmosaic-competitors", "--configs", "fedmosaic/offline_dynamc",
              "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
    assert ("--configs fedmosaic/offline_dynamc: not a config of the plans; choose from fedmosaic/offline_competitors, "
            "fedmosaic/offline_competitors_static") in capsys.readouterr().err


def test_an_unknown_plan_and_a_repository_without_configs_are_refused_in_one_sentence(capsys, tmp_path) -> None:
    from offline_runs import main

    with pytest.raises(SystemExit):
        main(["--repo", str(CONFIGS.parent), "--plan", "fedmosiac", "--out", str(tmp_path / "o")])
    assert "--plan fedmosiac: not a plan; choose from feddat-domain, " in capsys.readouterr().err
    with pytest.raises(SystemExit, match=f"--repo '{tmp_path}' has no configs/ folder: pass the rayfed repository's"):
        main(["--repo", str(tmp_path), "--plan", "fedmosaic", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
