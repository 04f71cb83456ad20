import copy
import pathlib

import pytest

from rayfed.results.report import format_table, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METHODS = ["local", "fedavg", "fedavg+post"]
# Non-contiguous ids so that string sorting ("10" < "2") would give a different order.
CLIENT_IDS = ["0", "1", "2", "9", "10"]
# Per-method accuracy offset: fedavg+post is best on local_acc, local is best (lowest) on local_loss.
ACC_BASE = {"local": 0.60, "fedavg": 0.70, "fedavg+post": 0.80}
COMM = {"local": (0, 0), "fedavg": (12_345_678, 23_456_789), "fedavg+post": (12_345_678, 2_500_000_000)}


def make_summary(generalization_metric: str | None = None) -> dict:
    methods = {}
    for method in METHODS:
        clients = {}
        for i, cid in enumerate(CLIENT_IDS):
            client = {
                "local_acc": ACC_BASE[method] + 0.01 * i,
                "local_loss": 0.2 + ACC_BASE[method] - 0.01 * i,
                "num_train": 60 + i,
                "num_test": 15,
            }
            if generalization_metric:
                client[generalization_metric] = 0.9 - ACC_BASE[method] / 2
            clients[cid] = client
        mean_acc = ACC_BASE[method] + 0.02 + 0.0012345
        mean = {"local_acc": mean_acc, "local_loss": 0.2 + ACC_BASE[method] - 0.02}
        std = {"local_acc": 0.0141421, "local_loss": 0.0141421}
        if generalization_metric:
            mean[generalization_metric] = 0.9 - ACC_BASE[method] / 2
            std[generalization_metric] = 0.0
        methods[method] = {"clients": clients, "mean": mean, "std": std}
    return {
        "rayfed_version": "0.1.0",
        "config": {"name": "quickstart", "seed": 7},
        "methods": methods,
        "wall_time_s": 95.24,
        "comm_bytes": {m: {"up": up, "down": down} for m, (up, down) in COMM.items()},
    }


def make_events(summary: dict) -> list[dict]:
    events = []
    for method, method_summary in summary["methods"].items():
        for rnd in range(1, 6):
            events.append(
                {
                    "event": "round",
                    "method": method,
                    "round": rnd,
                    "train_loss": 1.0 / rnd,
                    "up_bytes": 1000,
                    "down_bytes": 2000,
                    "clients": [0, 9],
                    "wall_s": 0.4,
                }
            )
            if rnd % 2 == 0:
                clients = {
                    cid: {k: v for k, v in c.items() if k not in ("num_train", "num_test")}
                    for cid, c in method_summary["clients"].items()
                }
                events.append(
                    {"event": "eval", "method": method, "round": rnd, **method_summary["mean"], "clients": clients}
                )
    return events


def table_rows(markdown: str, section: str) -> list[list[str]]:
    """Data rows of the first Markdown table after the heading starting with section."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(section))
    table = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip("|").split(" | ")])
        elif table:
            break
    return table[2:]  # drop header and separator


def assert_valid_png(path: pathlib.Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 10_000, f"{path} is suspiciously small ({len(data)} bytes)"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    """(run_dir, returned paths, report.md text) of one report shared by the read-only tests."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    summary = make_summary()
    paths = write_report(run_dir, summary, make_events(summary))
    return run_dir, paths, (run_dir / "report.md").read_text()


def test_writes_expected_files(report):
    run_dir, paths, _ = report
    assert paths == [run_dir / "curves.png", run_dir / "clients.png", run_dir / "report.md"]
    for png in paths[:2]:
        assert_valid_png(png)
    assert sorted(p.name for p in run_dir.iterdir()) == ["clients.png", "curves.png", "report.md"]  # no temp files


def test_title_and_wall_time(report):
    _, _, markdown = report
    assert markdown.splitlines()[0] == "# rayfed report: quickstart (seed 7)"
    assert "Wall time: 95.2 s." in markdown


def test_method_comparison_table(report):
    _, _, markdown = report
    rows = table_rows(markdown, "## Method comparison")
    assert [row[0] for row in rows] == METHODS
    by_method = {row[0]: row[1:] for row in rows}
    # Columns: local_acc, local_loss, upload, download; 4 significant digits.
    assert by_method["fedavg+post"] == ["0.8212 ± 0.01414", "0.9800 ± 0.01414", "12.35 MB", "2.50 GB"]
    assert by_method["fedavg"][:2] == ["0.7212 ± 0.01414", "0.8800 ± 0.01414"]
    assert by_method["local"][2:] == ["0 B", "0 B"]
    assert "| method | local_acc | local_loss | upload | download |" in markdown


def test_per_client_table_sorted_numerically(report):
    _, _, markdown = report
    assert "| client | local | fedavg | fedavg+post |" in markdown
    rows = table_rows(markdown, "## Per-client `local_acc`")
    assert [row[0] for row in rows] == CLIENT_IDS
    assert rows[3] == ["9", "0.6300", "0.7300", "0.8300"]  # 4th client has index 3 in the fixture


def test_best_method_named(report):
    _, _, markdown = report
    assert "**Best method on `local_acc`** (higher is better): `fedavg+post` (0.8212 ± 0.01414)." in markdown


def test_links_to_plots_are_relative(report):
    _, _, markdown = report
    assert "![curves](curves.png)" in markdown
    assert "![clients](clients.png)" in markdown
    assert "personalization_vs_generalization" not in markdown


@pytest.mark.parametrize("generalization_metric", ["novel_acc", "others_acc"])
def test_personalization_plot_only_with_generalization_metric(tmp_path, generalization_metric):
    summary = make_summary(generalization_metric)
    paths = write_report(tmp_path, summary, make_events(summary))
    plot = tmp_path / "personalization_vs_generalization.png"
    assert plot in paths
    assert_valid_png(plot)
    # The generalization metric is a metric like any other: it gets a comparison column.
    markdown = (tmp_path / "report.md").read_text()
    assert f"| method | local_acc | local_loss | {generalization_metric} | upload | download |" in markdown
    assert "![personalization_vs_generalization](personalization_vs_generalization.png)" in markdown
    assert table_rows(markdown, "## Method comparison")[0][3] == "0.6000 ± 0.000"


def test_output_is_deterministic(tmp_path):
    summary = make_summary("novel_acc")
    events = make_events(summary)
    first = {p.name: p.read_bytes() for p in write_report(tmp_path / "a", summary, events)}
    second = {p.name: p.read_bytes() for p in write_report(tmp_path / "b", copy.deepcopy(summary), events)}
    assert first == second


def test_primary_falls_back_to_first_metric_and_loss_is_minimised(tmp_path):
    summary = make_summary()
    for method_summary in summary["methods"].values():
        for client in method_summary["clients"].values():
            del client["local_acc"]
        del method_summary["mean"]["local_acc"]
    write_report(tmp_path, summary, events=[])
    markdown = (tmp_path / "report.md").read_text()
    assert "**Best method on `local_loss`** (lower is better): `local`" in markdown
    assert "## Per-client `local_loss`" in markdown
    # No events: nothing to draw curves from, and no dangling link to them.
    assert not (tmp_path / "curves.png").exists()
    assert "curves.png" not in markdown


def test_comm_falls_back_to_round_events(tmp_path):
    summary = make_summary()
    del summary["comm_bytes"]
    write_report(tmp_path, summary, make_events(summary))
    rows = table_rows((tmp_path / "report.md").read_text(), "## Method comparison")
    assert rows[1][-2:] == ["5.00 kB", "10.00 kB"]  # 5 rounds x 1000 up / 2000 down


def test_format_table_escapes_pipes_and_checks_width():
    assert format_table([["a|b", "1"]], ["name", "value"]) == "| name | value |\n| --- | --- |\n| a\\|b | 1 |\n"
    with pytest.raises(ValueError):
        format_table([["only one"]], ["name", "value"])
