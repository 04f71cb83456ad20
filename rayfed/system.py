"""Who takes part in a round once clients fail and straggle (``system:`` in the config).

A pure function of (config, round, sampled clients): the same plan whatever the execution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rayfed import seeding
from rayfed.config import RunConfig
from rayfed.training import local_steps


@dataclass(frozen=True)
class RoundPlan:
    participants: list[int]          # clients that train this round (sorted)
    dropped: list[int]               # sampled but dropped out: send nothing
    late: list[int]                  # missed the deadline (dropped or down-weighted, per late_policy)
    weight_scale: dict[int, float]   # aggregation weight factor of each participant
    sim_time: float                  # simulated duration of the round


def client_speed(config: RunConfig, client_id: int) -> float:
    system = config.system
    if client_id in system.speeds:
        return system.speeds[client_id]
    if system.speed_sigma == 0:
        return 1.0
    rng = seeding.numpy_rng(config.seed, 0, client_id, "speed")
    return float(np.exp(rng.normal(0.0, system.speed_sigma)))


def plan_round(config: RunConfig, round_idx: int, sampled: list[int], num_train: dict[int, int]) -> RoundPlan:
    system = config.system
    dropout = system.dropout_by_round.get(round_idx + 1, system.dropout)
    dropped = [
        cid for cid in sampled
        if dropout > 0 and seeding.numpy_rng(config.seed, round_idx, cid, "dropout").random() < dropout
    ]
    alive = [cid for cid in sampled if cid not in dropped]
    durations = {cid: local_steps(config.train, num_train[cid]) / client_speed(config, cid) for cid in alive}
    deadline = system.deadline
    late = [cid for cid in alive if deadline is not None and durations[cid] > deadline]
    if system.late_policy == "drop":
        participants = [cid for cid in alive if cid not in late]
        weight_scale = {cid: 1.0 for cid in participants}
    else:
        participants = alive
        weight_scale = {cid: system.late_weight if cid in late else 1.0 for cid in participants}
    longest = max(durations.values(), default=0.0)
    sim_time = min(longest, deadline) if deadline is not None else longest
    return RoundPlan(participants, dropped, late, weight_scale, sim_time)
