"""Where the actors go: the ClientActors' slots (by client count or by cost) fitted to the Ray cluster (or checked
against a Ray Tune trial's placement group), each actor's Ray options, and which actor trains which of a round's
clients."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayfed.architectures import ActorSlot, actor_clients, actor_slots, architecture_names, architecture_of
from rayfed.config import RunConfig, architecture_model_config, model_configs
from rayfed.data.clients import build_federation
from rayfed.errors import ConfigError
from rayfed.models import build_backbone
from rayfed.training import local_steps


def planned_costs(config: RunConfig, num_train: Mapping[int, int] | None = None) -> list[float] | None:
    """Each client's cost where ``placement.balance_by`` is ``cost`` (else None): the parameter count of its
    architecture's backbone, built once here (the adapters a method adds are a small part, and differ by method),
    times its local steps with its ``num_train`` training samples (default: counted on the federation built here)."""
    if config.placement.balance_by != "cost":
        return None
    if num_train is None:
        federation = build_federation(config.data, config.seed, model_configs(config))
        num_train = {cid: federation.sizes(cid)["num_train"] for cid in range(federation.num_clients)}
    # counted from shapes: random weights are not drawn (meta), loaded ones are loaded
    params = {name: sum(p.numel() for p in build_backbone(architecture_model_config(config, name), 0,
                                                          "meta").encoder.parameters())
              for name in architecture_names(config)}
    of = architecture_of(config)
    return [float(params[of[c]] * local_steps(config.train, num_train[c])) for c in range(config.data.num_clients)]


def fitted_slots(config: RunConfig, costs: Sequence[float] | None = None,
                 measured: Mapping[str, float] | None = None) -> list[ActorSlot]:
    """The ClientActors' slots (``costs``: see :func:`planned_costs`; ``measured``: the GPU shares of the
    architectures whose ``gpus_per_actor`` is ``measured``), once checked to fit the Ray cluster (or the Tune trial's
    placement group, whose bundles give the measured shares); outside a trial, as fitted to the cluster (see
    :func:`actor_slots`)."""
    placement = config.placement
    group = ray.util.get_current_placement_group()
    if group is not None:  # a Ray Tune trial: the actors must fit the bundles placed() puts them in
        bundles = group.bundle_specs
        first: dict[str, int] = {}  # each architecture's first actor, whose bundle trial_resources sized
        for index, (name, _) in enumerate(actor_clients(config, costs)):
            first.setdefault(name, index)
        from_bundles = {name: bundles[index + 1].get("GPU", 0.0) if index + 1 < len(bundles) else 0.0
                        for name, index in first.items()}  # too few bundles: the check below says so
        slots = actor_slots(config, costs=costs, measured={**from_bundles, **(measured or {})})
        needs = [{"CPU": placement.driver_cpus}] + [{"CPU": slot.cpus, "GPU": slot.gpus} for slot in slots]
        if len(bundles) < len(needs):
            raise ConfigError(
                f"placement: the DriverActor and {len(slots)} ClientActors need {len(needs)} bundles but the "
                f"trial's placement group has {len(bundles)}; size it with rayfed.tune.trial_resources(config)."
            )
        for index, (need, have) in enumerate(zip(needs, bundles)):
            if any(amount > have.get(resource, 0.0) + 1e-9 for resource, amount in need.items()):
                actor = "the DriverActor" if index == 0 else f"ClientActor {index - 1}"
                raise ConfigError(
                    f"placement: {actor} needs {need} but bundle {index} of the trial's placement group holds "
                    f"{have}; size the group with rayfed.tune.trial_resources(config)."
                )
        return slots
    available = ray.cluster_resources()
    slots = actor_slots(config, available.get("CPU", 0.0) - placement.driver_cpus, costs, measured)
    for resource, extra in (("CPU", placement.driver_cpus), ("GPU", 0.0)):
        per_actor = [slot.cpus if resource == "CPU" else slot.gpus for slot in slots]
        needed = sum(per_actor) + extra
        if needed > available.get(resource, 0.0) + 1e-9:
            raise ConfigError(
                f"placement: {len(slots)} ClientActors x {_each(per_actor)} {resource} (+ {extra:g} for the driver) "
                f"need {needed:g} {resource} but the Ray cluster has {available.get(resource, 0.0):g}; "
                "raise placement.clients_per_actor or lower placement."
                f"{'cpus' if resource == 'CPU' else 'gpus'}_per_actor."
            )
    refuse_split_gpu_shares([slot.gpus for slot in slots], available.get("GPU", 0.0), "ClientActors")
    return slots


def _each(per_actor: Sequence[float]) -> str:
    return f"{per_actor[0]:g}" if len(set(per_actor)) == 1 else "their"


def refuse_split_gpu_shares(shares: Sequence[float], cluster_gpus: float, holders: str) -> None:
    """Refuse the GPU ``shares`` of ``holders`` (actors, or a trial's bundles) when their sum fits the cluster's GPUs
    but the pieces do not: Ray keeps a share below 1 on one GPU, and would wait for a place forever."""
    gpus, holding = int(cluster_gpus + 1e-9), gpus_holding(shares)
    if holding > gpus:
        asking = [share for share in shares if share > 0]
        fitting = f" (to {even_gpu_share(len(asking), gpus):g} here)" if len(set(asking)) == 1 else ""
        raise ConfigError(
            f"placement: {len(asking)} {holders} x {_each(asking)} GPU take {holding} GPUs, as Ray gives a share "
            f"below 1 a place on one GPU, but the Ray cluster has {gpus}; lower placement.gpus_per_actor{fitting} "
            "or raise placement.clients_per_actor."
        )


def even_gpu_share(actors: int, gpus: int) -> float:
    """The largest equal GPU share (at most a whole GPU) with which ``actors`` actors fit ``gpus`` GPUs: the most
    actors a GPU then holds share it evenly, rounded down to a hundredth."""
    return math.floor(100 / math.ceil(actors / max(gpus, 1))) / 100


def gpus_holding(shares: Sequence[float]) -> int:
    """How many GPUs actors asking for ``shares`` of a GPU take: a share of 1 or more that many whole GPUs, a share
    below 1 a place on one GPU (Ray does not split it over two), packed largest first, each into the first GPU with
    room."""
    loads: list[float] = []
    for share in sorted((share for share in shares if 0 < share < 1), reverse=True):
        room = next((index for index, load in enumerate(loads) if load + share <= 1 + 1e-9), None)
        if room is None:
            loads.append(share)
        else:
            loads[room] += share
    return sum(math.ceil(share) for share in shares if share >= 1) + len(loads)


def placed(options: dict[str, Any], bundle_index: int) -> dict[str, Any]:
    """Inside a Ray Tune trial, put the actor in the trial's placement group (bundle 0: the driver)."""
    group = ray.util.get_current_placement_group() if ray.is_initialized() else None
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle_index)
    return options


def assign(client_ids: list[int], slots: list[ActorSlot], host_of: dict[int, int],
           balance: bool) -> dict[int, list[int]]:
    """Which actor trains which of the round's clients: their hosts, or (``balance``: ``placement.balance_rounds``)
    the actors of each architecture in even shares."""
    if balance:
        return balanced_assignment(client_ids, slots, host_of)
    groups: dict[int, list[int]] = {}
    for cid in client_ids:
        groups.setdefault(host_of[cid], []).append(cid)
    return groups


def balanced_assignment(client_ids: list[int], slots: list[ActorSlot], host_of: dict[int, int]) -> dict[int, list[int]]:
    """The round's clients spread over the actors of their architecture in shares that differ by at most one;
    each client stays on its host while the host is within its share, the rest go to the actors with room
    (in actor order). The larger shares go to the actors hosting the most of the round's clients, so that as
    few clients as possible move."""
    assignment: dict[int, list[int]] = {}
    for architecture in dict.fromkeys(slot.architecture for slot in slots):
        actors = [index for index, slot in enumerate(slots) if slot.architecture == architecture]
        clients = sorted(c for c in client_ids if slots[host_of[c]].architecture == architecture)
        if not clients:
            continue
        hosted = {actor: sum(host_of[c] == actor for c in clients) for actor in actors}
        by_load = sorted(actors, key=lambda actor: (-hosted[actor], actor))
        base, extra = divmod(len(clients), len(actors))
        share = {actor: base + (rank < extra) for rank, actor in enumerate(by_load)}
        placed: dict[int, list[int]] = {actor: [] for actor in actors}
        overflow = []
        for client in clients:
            host = host_of[client]
            (placed[host] if len(placed[host]) < share[host] else overflow).append(client)
        for client in overflow:
            placed[next(actor for actor in actors if len(placed[actor]) < share[actor])].append(client)
        assignment.update({actor: sorted(group) for actor, group in placed.items() if group})
    return assignment
