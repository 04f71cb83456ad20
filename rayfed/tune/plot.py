"""The sweep's plot: the metric against each swept value."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rayfed.io import atomic_write_bytes
from rayfed.tune.tables import TrialRecord, _cell

if TYPE_CHECKING:
    from rayfed.tune.sweep import _Sweep


def _write_plot(path: Path, sweep: _Sweep, records: list[TrialRecord], best: TrialRecord) -> None:
    """One panel per swept path: the metric of every trial (hollow: stopped early), the best starred."""
    paths = sweep.space.paths
    cols = min(len(paths), 3)
    rows = math.ceil(len(paths) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    measured = [r for r in records if r.metric is not None and not math.isnan(r.metric)]
    for ax, swept_path in zip(axes, paths, strict=False):  # spare panels of the last row stay empty
        values = [r.params[swept_path] for r in measured]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            position = dict(zip(map(id, measured), values, strict=True))
            if sweep.space.log_scale(swept_path):
                ax.set_xscale("log")
            elif all(isinstance(v, int) for v in values):
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        else:  # vectors, strings, booleans: one tick per distinct value
            labels = list(dict.fromkeys(_cell(v) for v in values))
            position = {id(r): labels.index(_cell(v)) for r, v in zip(measured, values, strict=True)}
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
        for status, style in (("completed", {"color": "tab:blue"}),
                              ("stopped early", {"facecolors": "none", "edgecolors": "tab:gray"})):
            group = [r for r in measured if r.status == status]
            if group:
                ax.scatter([position[id(r)] for r in group], [r.metric for r in group], label=status, **style)
        ax.scatter([position[id(best)]], [best.metric], marker="*", s=180, color="tab:red", label="best")
        ax.set_xlabel(swept_path)
        ax.set_ylabel(sweep.spec.metric)
        ax.grid(alpha=0.3)
    for ax in axes[len(paths):]:
        ax.set_visible(False)
    axes[0].legend(fontsize="small")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, metadata={"Software": None})
    atomic_write_bytes(path, buffer.getvalue())
