"""What the run does when a number goes NaN or infinite (``federation.on_nonfinite``): stop with one sentence naming
it, or warn once per method and go on."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

from rayfed.method import NonFiniteError
from rayfed.simulation.results import COUNT_KEYS


class NonfiniteCheck:
    """``federation.on_nonfinite`` applied to a round's statistics and to evaluations' metrics."""

    def __init__(self, on_nonfinite: str):
        self.on_nonfinite = on_nonfinite
        self.warned: set[str] = set()

    def in_metrics(self, label: str, when: str, clients: Mapping[int, dict[str, float]]) -> dict[str, Any]:
        """``{"nonfinite": {metric: [clients]}}`` for the metrics some clients report as NaN or infinite (the means
        leave them out), after :meth:`__call__`; ``{}`` when every value is finite."""
        found: dict[str, list[int]] = {}
        for cid in sorted(clients):
            for name, value in clients[cid].items():
                if name not in COUNT_KEYS and not math.isfinite(value):
                    found.setdefault(name, []).append(cid)
        if not found:
            return {}
        self(label, when, {f"metric {name!r}": cids for name, cids in found.items()})
        return {"nonfinite": found}

    def __call__(self, label: str, when: str, found: Mapping[str, list[int]]) -> None:
        """Stop the run with one sentence naming what went NaN or infinite, or (``federation.on_nonfinite: warn``)
        warn once per method and go on. Stopping comes before the round's checkpoint: the last one written stays."""
        shown = [f"{what} (client{'s' if len(cids) > 1 else ''} {', '.join(map(str, cids))})"
                 for what, cids in list(found.items())[:2]]
        more = f" and {len(found) - 2} more" if len(found) > 2 else ""
        message = f"method {label!r} went non-finite {when}: {'; '.join(shown)}{more}"
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"{message}; the run stops, keeping the last checkpoint written before it "
                                 "(federation.on_nonfinite: warn goes on instead).")
        if label not in self.warned:
            self.warned.add(label)
            warnings.warn(f"{message}; going on (federation.on_nonfinite: warn), and the means leave non-finite "
                          "values out.", RuntimeWarning, stacklevel=2)
