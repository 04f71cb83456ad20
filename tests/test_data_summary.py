"""`rayfed data` and `Simulation.data_summary`: each client's counts and label histogram, before a run (no Ray)."""

from __future__ import annotations

import numpy as np
import yaml

from rayfed.cli import main
from rayfed.config import load_config
from rayfed.data.clients import build_federation
from rayfed.simulation import Simulation

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _federation(config: dict):
    loaded = load_config(config)
    return build_federation(loaded.data, loaded.seed)


def test_counts_are_the_federation_sizes_and_cover_every_train_sample(tiny_run):
    summary = Simulation(tiny_run).data_summary()
    federation = _federation(tiny_run)
    (holding,) = federation.holdings
    assert list(summary["clients"]) == list(range(federation.num_clients))
    for cid, client in summary["clients"].items():
        assert {k: client[k] for k in ("num_train", "num_test")} == federation.sizes(cid)
    every_train = np.concatenate([train for train, _ in holding.splits])
    every_test = np.concatenate([test for _, test in holding.splits])
    assert summary["total"]["num_train"] == sum(c["num_train"] for c in summary["clients"].values())
    assert summary["total"]["num_train"] == len(np.unique(every_train))
    assert summary["total"]["num_test"] == len(np.unique(every_test))


def test_label_histograms_sum_to_the_train_counts_and_show_the_dirichlet_skew(tiny_run):
    summary = Simulation(tiny_run).data_summary()
    dataset = _federation(tiny_run).holdings[0].dataset
    assert summary["by"] == "label"
    assert summary["categories"] == list(dataset.class_names)
    histograms = np.array([c["counts"] for c in summary["clients"].values()])
    assert histograms.shape == (tiny_run["data"]["num_clients"], tiny_run["data"]["synthetic"]["num_classes"])
    assert histograms.sum(axis=1).tolist() == [c["num_train"] for c in summary["clients"].values()]
    # Dirichlet(0.5): some client's label distribution is far from the pooled one (an iid split is not).
    shares = histograms / histograms.sum(axis=1, keepdims=True)
    pooled = histograms.sum(axis=0) / histograms.sum()
    assert np.abs(shares - pooled).sum(axis=1).max() > 0.4
    assert len({tuple(row) for row in histograms.tolist()}) == len(histograms)


def test_an_iid_split_gives_near_uniform_histograms(tiny_run):
    tiny_run["data"]["partition"] = {"name": "iid"}
    histograms = np.array([c["counts"] for c in Simulation(tiny_run).data_summary()["clients"].values()])
    shares = histograms / histograms.sum(axis=1, keepdims=True)
    assert np.abs(shares - histograms.sum(axis=0) / histograms.sum()).sum(axis=1).max() < 0.4


def _table_rows(printed: str) -> dict[str, list[str]]:
    """The table's client lines (first cell a client id), as their cells."""
    cells = [line.split() for line in printed.splitlines()]
    return {row[0]: row for row in cells if row and row[0].isdigit()}


def test_cli_prints_one_line_per_client_and_writes_the_png(tiny_run, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_run))
    assert main(["data", str(config), "seed=4", "--out", str(tmp_path / "plots")]) == 0
    printed = capsys.readouterr().out
    png = tmp_path / "plots" / "data.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 1000
    rows = _table_rows(printed)
    summary = Simulation(tiny_run, overrides=["seed=4"]).data_summary()
    assert sorted(rows) == [str(cid) for cid in summary["clients"]]
    for cid, client in summary["clients"].items():
        expected = [cid, client["num_train"], client["num_test"], *client["counts"]]
        assert rows[str(cid)] == [str(cell) for cell in expected]
    assert summary != Simulation(tiny_run).data_summary()  # the override reached the partition


def test_cli_shows_at_most_rows_clients_and_defaults_beside_the_run_folder(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_run))
    assert main(["data", "tiny.yaml", "--rows", "2"]) == 0
    printed = capsys.readouterr().out
    assert sorted(_table_rows(printed)) == ["0", "1"]
    assert "2 more clients" in printed
    assert (tmp_path / "runs" / "tiny-data.png").read_bytes()[:8] == PNG_SIGNATURE
    assert not (tmp_path / "runs" / "tiny").exists()  # a later `rayfed run` still starts in runs/tiny/


def test_cli_names_a_bad_config_in_one_sentence(tiny_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_run))
    assert main(["data", "tiny.yaml", "data.partition.alpha=-1"]) == 2
    error = capsys.readouterr().err
    assert "data.partition.alpha" in error and not (tmp_path / "runs").exists()


def test_a_multi_task_config_is_counted_per_task(tiny_run):
    def task(name: str, clients: list[int], classes: int) -> dict:
        return {"name": name, "source": "synthetic", "clients": clients, "partition": {"name": "iid"},
                "options": {"num_samples": 60 + 7 * classes, "num_classes": classes, "image_size": 8}}

    tiny_run["data"] = {"tasks": [task("a", [0, 1], 3), task("b", [1, 2], 4)]}
    summary = Simulation(tiny_run).data_summary()
    federation = _federation(tiny_run)
    assert summary["by"] == "task" and summary["categories"] == ["a", "b"]
    counts = {cid: client["counts"] for cid, client in summary["clients"].items()}
    assert counts[0][1] == 0 and counts[2][0] == 0 and min(counts[1]) > 0
    for position, holding in enumerate(federation.holdings):
        assert sum(c[position] for c in counts.values()) == sum(len(train) for train, _ in holding.splits)
    assert [sum(c) for c in counts.values()] == [client["num_train"] for client in summary["clients"].values()]
