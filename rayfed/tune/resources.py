"""The placement group one trial of a config runs in."""

from __future__ import annotations

from ray import tune as ray_tune

from rayfed.architectures import actor_slots
from rayfed.config import RunConfig
from rayfed.simulation.gpu_memory import GpuMemory, measures_memory
from rayfed.simulation.placement import planned_costs

TRIAL_DRIVER_CPUS = 0.25
"""Smallest CPU share of bundle 0, where a trial's round loop runs next to its DriverActor."""


def trial_resources(config: RunConfig, gpu_memory: GpuMemory | None = None) -> ray_tune.PlacementGroupFactory:
    """The placement group of one trial of ``config``: the DriverActor's bundle, then one per ClientActor.

    An architecture whose ``gpus_per_actor`` is ``measured`` gets its measured share (``gpu_memory``'s, measured now
    if it has none for this configuration; default: measured now, kept nowhere), so trials pack onto GPUs by memory.

    The head bundle is empty, so Tune runs the trial function itself in bundle 0 without
    reserving anything for it, next to the DriverActor; bundle ``i + 1`` is ClientActor ``i``
    (the layout ``rayfed.simulation.placement.placed`` uses). With ``placement.executor: local`` the trial's
    own process runs every actor, one after another: one bundle, as large as the largest actor's.
    """
    placement = config.placement
    costs = planned_costs(config)
    measured = (gpu_memory or GpuMemory()).shares(config, costs) if measures_memory(config) else None
    slots = actor_slots(config, costs=costs, measured=measured)
    if placement.executor == "local":
        cpus = max(placement.driver_cpus, TRIAL_DRIVER_CPUS, *(slot.cpus for slot in slots))
        gpus = max(slot.gpus for slot in slots)
        return ray_tune.PlacementGroupFactory([{"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}])
    client_bundles = [{"CPU": slot.cpus, "GPU": slot.gpus} for slot in slots]
    return ray_tune.PlacementGroupFactory(
        [{}, {"CPU": max(placement.driver_cpus, TRIAL_DRIVER_CPUS)}, *client_bundles],
        strategy="SPREAD" if placement.strategy == "SPREAD" else "PACK",
    )
