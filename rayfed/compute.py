"""Compute matching (``train.compute_match``): local steps per method such that every method's local update costs
about what the reference method's does.

A method's cost is the FLOPs of one client's local update as :class:`torch.utils.flop_counter.FlopCounterMode`
counts them: matrix products, convolutions and attention, forward and backward (not the optimizer's elementwise
updates), measured on the run's model and data with ``train.local_steps`` steps for every method, so that work a
method does once per update or every few steps is part of its cost. With C = FLOPs(method) / FLOPs(reference),
the method trains ``round(train.local_steps / C)`` steps (halves up). A method that counts no FLOPs (it trains
nothing) keeps ``train.local_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

from rayfed.errors import ConfigError


def counted_flops(work: Callable[[], Any]) -> float:
    """The FLOPs ``work()`` runs (matrix products, convolutions, attention; forward and backward)."""
    counter = FlopCounterMode(display=False)
    with counter:
        work()
    return float(counter.get_total_flops())


def matched_steps(flops: Mapping[str, float], reference: str, reference_steps: int) -> dict[str, dict[str, float]]:
    """Per method label: its measured ``flops``, ``cost_ratio`` C to ``reference`` and the ``local_steps`` it trains,
    ``round(reference_steps / C)``."""
    base = flops[reference]
    if base <= 0:
        raise ConfigError(f"train.compute_match.reference = {reference!r} counts no FLOPs in a local update (it trains "
                          "nothing), so no cost can be relative to it; choose a method that trains.")
    matched = {}
    for label, count in flops.items():
        ratio = count / base
        steps = reference_steps if ratio == 0 else math.floor(reference_steps / ratio + 0.5)
        if steps < 1:
            raise ConfigError(f"train.compute_match: method {label!r} costs {ratio:.3g} times the reference "
                              f"{reference!r} per update, so it would train no step of train.local_steps = "
                              f"{reference_steps}; raise train.local_steps to at least {math.ceil(ratio / 2)}.")
        matched[label] = {"flops": count, "cost_ratio": ratio, "local_steps": steps}
    return matched
