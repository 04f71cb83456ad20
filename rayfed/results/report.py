"""Human-facing results of a run: ``report.md`` plus PNG plots.

Inputs are what the engine already produced: the summary dict (also saved as
``summary.json``) and the parsed lines of ``metrics.jsonl``.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import tempfile
from collections.abc import Iterable, Mapping

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

PRIMARY_METRIC = "local_acc"
# Generalization metrics paired with PRIMARY_METRIC in the trade-off scatter, by preference.
GENERALIZATION_METRICS = ("novel_acc", "others_acc")
MAX_CURVE_METRICS = 4

REPORT_NAME = "report.md"
CURVES_NAME = "curves.png"
CLIENTS_NAME = "clients.png"
TRADEOFF_NAME = "personalization_vs_generalization.png"

# Numeric keys that are bookkeeping, not metrics.
_NON_METRIC_KEYS = frozenset({"num_train", "num_test", "round", "wall_s", "up_bytes", "down_bytes"})
_MISSING = "—"


def write_report(run_dir: str | os.PathLike, summary: dict, events: list[dict]) -> list[pathlib.Path]:
    """Write report.md and PNG plots into run_dir; return the paths written.

    Plots are written first (in the order curves, clients, personalization vs
    generalization) so that report.md links only to files that exist; a plot
    with nothing to show is skipped. report.md is always written, last.
    """
    run_dir = pathlib.Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    methods_summary: dict[str, dict] = summary.get("methods", {})
    methods = _ordered_methods(methods_summary, events)
    summary_metrics = _summary_metrics(methods_summary)
    eval_metrics = _event_metrics(events, "eval")
    primary = _primary_metric(summary_metrics or eval_metrics)

    written: list[pathlib.Path] = []
    curves = _plot_curves(events, methods, eval_metrics, primary)
    if curves is not None:
        written.append(_save_figure(curves, run_dir / CURVES_NAME))
    if primary is not None and methods_summary:
        written.append(_save_figure(_plot_clients(methods_summary, methods, primary), run_dir / CLIENTS_NAME))
    generalization = _generalization_metric(methods_summary)
    if generalization is not None:
        tradeoff = _plot_tradeoff(methods_summary, methods, generalization)
        written.append(_save_figure(tradeoff, run_dir / TRADEOFF_NAME))

    markdown = _render_markdown(run_dir, summary, events, methods, summary_metrics, primary, written)
    report_path = run_dir / REPORT_NAME
    _atomic_write(report_path, markdown.encode("utf-8"))
    written.append(report_path)
    return written


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """Render a GitHub-flavoured Markdown table (trailing newline included).

    Pipes inside cells are escaped so arbitrary labels cannot break the layout.
    """
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row has {len(row)} cells but header has {len(header)}: {row!r}")

    def line(cells: Iterable[str]) -> str:
        return "| " + " | ".join(str(cell).replace("|", r"\|") for cell in cells) + " |"

    lines = [line(header), line("---" for _ in header)]
    lines.extend(line(row) for row in rows)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Extracting metrics


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_keys(record: Mapping) -> list[str]:
    return [key for key, value in record.items() if _is_number(value) and key not in _NON_METRIC_KEYS]


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _ordered_methods(methods_summary: Mapping[str, dict], events: list[dict]) -> list[str]:
    """Summary order first, then methods seen only in events, in first-seen order."""
    return _unique([*methods_summary, *(e["method"] for e in events if "method" in e)])


def _summary_metrics(methods_summary: Mapping[str, dict]) -> list[str]:
    """Every metric a client reports, but the per-task ones of clients holding several tasks (``<task>/...``),
    which the per-task table shows."""
    return _unique(
        key
        for method in methods_summary.values()
        for _, client in sorted(method.get("clients", {}).items(), key=lambda item: int(item[0]))
        for key in _metric_keys(client)
        if "/" not in key
    )


def _group_table(methods_summary: Mapping[str, dict], methods: list[str], group: str) -> str | None:
    """A table of one row per method and a column per (task or kind, metric) of the summary's ``group``."""
    columns = _unique(
        (name, metric)
        for method in methods
        for name, means in methods_summary.get(method, {}).get(group, {}).items()
        for metric in means
    )
    if not columns:
        return None
    rows = [[method, *(_fmt_number(methods_summary.get(method, {}).get(group, {}).get(name, {}).get(metric))
                       for name, metric in columns)] for method in methods]
    return format_table(rows, ["method", *(f"{name}: {metric}" for name, metric in columns)])


def _event_metrics(events: list[dict], kind: str) -> list[str]:
    return _unique(key for event in events if event.get("event") == kind for key in _metric_keys(event))


def _primary_metric(metrics: list[str]) -> str | None:
    if PRIMARY_METRIC in metrics:
        return PRIMARY_METRIC
    return metrics[0] if metrics else None


def _primary_first(metrics: list[str], primary: str | None) -> list[str]:
    return sorted(metrics, key=lambda metric: metric != primary)  # stable: keeps the rest in order


def _lower_is_better(metric: str) -> bool:
    return any(word in metric for word in ("loss", "error", "mse", "perplexity"))


def _sorted_clients(clients: Iterable[str]) -> list[str]:
    return sorted(clients, key=int)


def _generalization_metric(methods_summary: Mapping[str, dict]) -> str | None:
    """The generalization metric to pair with PRIMARY_METRIC, if any client reports both."""
    for candidate in GENERALIZATION_METRICS:
        for method in methods_summary.values():
            for client in method.get("clients", {}).values():
                if _is_number(client.get(PRIMARY_METRIC)) and _is_number(client.get(candidate)):
                    return candidate
    return None


def _client_values(method_summary: Mapping, metric: str) -> dict[str, float]:
    return {
        client_id: float(client[metric])
        for client_id, client in method_summary.get("clients", {}).items()
        if _is_number(client.get(metric))
    }


def _best_method(methods_summary: Mapping[str, dict], methods: list[str], metric: str) -> str | None:
    """Method with the best mean over clients on metric; ties go to the earlier method."""
    means = {m: methods_summary.get(m, {}).get("mean", {}).get(metric) for m in methods}
    scored = [(float(v), m) for m, v in means.items() if _is_number(v) and not math.isnan(v)]
    if not scored:
        return None
    choose = min if _lower_is_better(metric) else max
    return choose(scored, key=lambda pair: pair[0])[1]


# ---------------------------------------------------------------------------
# Markdown


def _fmt_number(value: object) -> str:
    return f"{float(value):#.4g}" if _is_number(value) else _MISSING


def _fmt_mean_std(method_summary: Mapping, metric: str) -> str:
    """``mean ± std``, marked with the number of clients whose value was NaN or infinite (left out of both)."""
    mean = method_summary.get("mean", {}).get(metric)
    std = method_summary.get("std", {}).get(metric)
    if not _is_number(mean):
        return _MISSING
    nonfinite = len(method_summary.get("nonfinite", {}).get(metric, ()))
    marked = f" ({nonfinite} non-finite)" if nonfinite else ""
    return f"{_fmt_number(mean)} ± {_fmt_number(std)}{marked}"


def _fmt_bytes(num_bytes: object) -> str:
    if not _is_number(num_bytes):
        return _MISSING
    value = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            break
        value /= 1000
    return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"


def _comm_totals(summary: Mapping, events: list[dict], method: str) -> tuple[object, object]:
    """(upload, download) bytes: summary totals, else the sum over round events."""
    comm = summary.get("comm_bytes", {}).get(method)
    if comm is not None:
        return comm.get("up"), comm.get("down")
    rounds = [e for e in events if e.get("event") == "round" and e.get("method") == method]
    if not rounds:
        return None, None
    return sum(e.get("up_bytes", 0) for e in rounds), sum(e.get("down_bytes", 0) for e in rounds)



# summary.json's groupings that get a table of their own in report.md: (key, heading, what a row means)
_GROUP_SECTIONS = (
    ("kinds", "Avg. per task kind", "Each task kind's metrics, averaged over every (client, task) pair of that kind: "
     "the papers' client-weighted \"Avg.\" columns."),
    ("stream", "Data streams: A_last and A_AUC", "Self: each client on its own tasks seen so far; Others: on the other "
     "clients' seen tasks. A_last is the value at the end, A_AUC the mean over the evaluation points."),
    ("architectures", "Per architecture", "Each architecture's metrics, averaged over its clients."),
    ("tasks", "Per task", "Each task's metrics, averaged over the clients holding it."),
)


def _render_markdown(
    run_dir: pathlib.Path,
    summary: Mapping,
    events: list[dict],
    methods: list[str],
    metrics: list[str],
    primary: str | None,
    plots: list[pathlib.Path],
) -> str:
    config = summary.get("config", {})
    name = config.get("name", run_dir.name)
    seed = config.get("seed", _MISSING)
    methods_summary: Mapping[str, dict] = summary.get("methods", {})
    metrics = _primary_first(metrics, primary)

    out = [f"# rayfed report: {name} (seed {seed})\n"]
    if "rayfed_version" in summary:
        out.append(f"rayfed version {summary['rayfed_version']}.\n")

    out.append("## Method comparison\n")
    out.append("Metrics are mean ± std over clients (each client counts once; \"(k non-finite)\": k clients' NaN or "
               "infinite values are left out); communication is the run total.\n")
    header = ["method", *metrics, "upload", "download"]
    rows = []
    for method in methods:
        method_summary = methods_summary.get(method, {})
        up, down = _comm_totals(summary, events, method)
        rows.append([method, *(_fmt_mean_std(method_summary, m) for m in metrics), _fmt_bytes(up), _fmt_bytes(down)])
    out.append(format_table(rows, header))

    for group, heading, blurb in _GROUP_SECTIONS:
        table = _group_table(methods_summary, methods, group)
        if table is not None:
            out += [f"## {heading}\n", f"{blurb}\n", table]

    if primary is not None:
        best = _best_method(methods_summary, methods, primary)
        direction = "lower" if _lower_is_better(primary) else "higher"
        if best is None:
            out.append(f"No method reports a mean `{primary}`.\n")
        else:
            best_value = _fmt_mean_std(methods_summary[best], primary)
            out.append(f"**Best method on `{primary}`** ({direction} is better): `{best}` ({best_value}).\n")

        out.append(f"## Per-client `{primary}`\n")
        per_method = {m: _client_values(methods_summary.get(m, {}), primary) for m in methods}
        client_ids = _sorted_clients(_unique(c for values in per_method.values() for c in values))
        client_rows = [[cid, *(_fmt_number(per_method[m].get(cid)) for m in methods)] for cid in client_ids]
        out.append(format_table(client_rows, ["client", *methods]))

    if plots:
        out.append("## Plots\n")
        out.extend(f"![{path.stem}]({path.name})\n" for path in plots)

    wall_time = summary.get("wall_time_s")
    if _is_number(wall_time):
        out.append(f"Wall time: {float(wall_time):.1f} s.\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Plots


def _method_colors(methods: list[str]) -> dict[str, str]:
    """Stable colour per method across all plots of a report."""
    return {method: f"C{i % 10}" for i, method in enumerate(methods)}


def _series(events: list[dict], kind: str, method: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted(
        (e["round"], float(e[key]))
        for e in events
        if e.get("event") == kind and e.get("method") == method and _is_number(e.get(key)) and "round" in e
    )
    return [r for r, _ in points], [v for _, v in points]


def _plot_curves(events: list[dict], methods: list[str], eval_metrics: list[str], primary: str | None) -> Figure | None:
    # the primary metric, then a stream's Self / Others curves, then the rest
    ordered = sorted(eval_metrics, key=lambda m: (m != primary, not m.startswith(("self_", "others_"))))
    panels = [("eval", m) for m in ordered[:MAX_CURVE_METRICS]]
    if "train_loss" in _event_metrics(events, "round"):
        panels.append(("round", "train_loss"))
    if not panels:
        return None

    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colors = _method_colors(methods)
    for ax, (kind, key) in zip(axes, panels):
        for method in methods:
            rounds, values = _series(events, kind, method, key)
            if rounds:
                ax.plot(rounds, values, marker="o", markersize=3, label=method, color=colors[method])
        ax.set_title(f"{key} ({'train' if kind == 'round' else 'eval'} mean)")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return fig


def _plot_clients(methods_summary: Mapping[str, dict], methods: list[str], metric: str) -> Figure:
    per_method = {m: _client_values(methods_summary.get(m, {}), metric) for m in methods}
    client_ids = _sorted_clients(_unique(c for values in per_method.values() for c in values))
    bar_width = 0.8 / max(len(methods), 1)
    width = min(30.0, max(6.0, 0.3 * len(client_ids) * len(methods)))
    fig = Figure(figsize=(width, 4.5), layout="constrained")
    ax = fig.subplots()
    colors = _method_colors(methods)
    for i, method in enumerate(methods):
        positions = [x + (i - (len(methods) - 1) / 2) * bar_width for x in range(len(client_ids))]
        heights = [per_method[method].get(cid, math.nan) for cid in client_ids]
        ax.bar(positions, heights, width=bar_width, label=method, color=colors[method])
    ax.set_xticks(range(len(client_ids)), client_ids, rotation=90 if len(client_ids) > 20 else 0)
    ax.set_xlabel("client")
    ax.set_ylabel(metric)
    ax.set_title(f"Per-client {metric}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _plot_tradeoff(methods_summary: Mapping[str, dict], methods: list[str], generalization: str) -> Figure:
    fig = Figure(figsize=(5.5, 5), layout="constrained")
    ax = fig.subplots()
    colors = _method_colors(methods)
    for method in methods:
        clients = methods_summary.get(method, {}).get("clients", {})
        points = [
            (float(clients[cid][PRIMARY_METRIC]), float(clients[cid][generalization]))
            for cid in _sorted_clients(clients)
            if _is_number(clients[cid].get(PRIMARY_METRIC)) and _is_number(clients[cid].get(generalization))
        ]
        if points:
            ax.scatter([x for x, _ in points], [y for _, y in points], label=method, color=colors[method], alpha=0.8)
    ax.set_xlabel(f"{PRIMARY_METRIC} (personalization)")
    ax.set_ylabel(f"{generalization} (generalization)")
    ax.set_title("Personalization vs generalization (one point per client)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


# ---------------------------------------------------------------------------
# Files


def _save_figure(fig: Figure, path: pathlib.Path) -> pathlib.Path:
    buffer = io.BytesIO()
    # No Software metadata: the PNG bytes then depend only on the data, not the matplotlib version.
    fig.savefig(buffer, format="png", dpi=120, metadata={"Software": None})
    _atomic_write(path, buffer.getvalue())
    return path


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    """Write via a temp file in the same directory so readers never see a partial file."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; results should be readable like any other file
        os.replace(tmp_name, path)
    except BaseException:
        os.unlink(tmp_name)
        raise
