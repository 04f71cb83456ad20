"""Compute matching (``train.compute_match``): local steps per method such that every method's work per round costs
about what the reference method's does.

A method's cost is the FLOPs of one client's local update as :class:`torch.utils.flop_counter.FlopCounterMode`
counts them: matrix products, convolutions and attention, forward and backward (not the optimizer's elementwise
updates), measured on the run's model and data with ``train.local_steps`` steps for every method, so that work a
method does once per update or every few steps is part of its cost; plus, for a method with server-side passes on
public data (a ``PublicPassStage``, e.g. distillation), the client's share of them: the FLOPs of the passes that
round 1 ran on the client's architecture over the clients of that architecture in the round. With C = cost(method) /
cost(reference), the method trains ``round(train.local_steps / C)`` steps (halves up), C counted per local step as a
relative cost per iteration is. A method that counts no FLOPs (it trains nothing) keeps ``train.local_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from torch.utils.flop_counter import FlopCounterMode

from rayfed.errors import ConfigError

Result = TypeVar("Result")
# The override that turns compute matching off, for a run of some of a config's methods: its reference may be gone.
WITHOUT_MATCHING = "train.compute_match=null"


def counted(work: Callable[[], Result]) -> tuple[Result, float]:
    """What ``work()`` returns and the FLOPs it runs (matrix products, convolutions, attention; forward and
    backward)."""
    counter = FlopCounterMode(display=False)
    with counter:
        result = work()
    return result, float(counter.get_total_flops())


def counted_flops(work: Callable[[], Any]) -> float:
    """The FLOPs ``work()`` runs (matrix products, convolutions, attention; forward and backward)."""
    return counted(work)[1]


def matched_steps(flops: Mapping[str, float], reference: str, reference_steps: int,
                  server_flops: Mapping[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Per method label: its local update's measured ``flops``, its client's share of the server's passes
    (``server_flops``, 0 without them), ``cost_ratio`` C of their sum to the reference's and the ``local_steps`` it
    trains, ``round(reference_steps / C)``."""
    server_flops = server_flops or {}
    cost = {label: count + server_flops.get(label, 0.0) for label, count in flops.items()}
    base = cost[reference]
    if base <= 0:
        raise ConfigError(f"train.compute_match.reference = {reference!r} counts no FLOPs in a local update (it trains "
                          "nothing), so no cost can be relative to it; choose a method that trains.")
    matched = {}
    for label, count in cost.items():
        ratio = count / base
        steps = reference_steps if ratio == 0 else math.floor(reference_steps / ratio + 0.5)
        if steps < 1:
            raise ConfigError(f"train.compute_match: method {label!r} costs {ratio:.3g} times the reference "
                              f"{reference!r} per update, so it would train no step of train.local_steps = "
                              f"{reference_steps}; raise train.local_steps to at least {math.ceil(ratio / 2)}.")
        matched[label] = {"flops": flops[label], "server_flops": server_flops.get(label, 0.0), "cost_ratio": ratio,
                          "local_steps": steps}
    return matched
