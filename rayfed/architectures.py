"""Clients of different architectures in one run (``architectures:`` in the config).

Every client has one architecture (a backbone and model config); a ClientActor hosts clients of one
architecture only, and the server keeps one initial state per architecture. The server sees each
parameter name prefixed by its architecture (``small/<name>``), so a per-tensor rule such as FedAvg
aggregates within an architecture; a client sends and receives its own architecture's names as they
are. A run without ``architectures:`` has one architecture, ``""``, and no prefixes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rayfed.config import RunConfig
from rayfed.config.sections import MEASURED
from rayfed.param_names import behind, prefixed_name

T = TypeVar("T")


@dataclass(frozen=True)
class ActorSlot:
    """One ClientActor: its architecture, the clients it hosts, and the resources it asks for."""

    architecture: str
    client_ids: tuple[int, ...]
    cpus: float
    gpus: float


def architecture_names(config: RunConfig) -> list[str]:
    """The run's architectures, in config order (``[""]`` for a run of one)."""
    return list(config.architectures) if config.architectures else [""]


def architecture_of(config: RunConfig) -> list[str]:
    """The architecture of every client id."""
    if not config.architectures:
        return [""] * config.data.num_clients
    owner = {client: name for name, group in config.architectures.items() for client in group.clients}
    return [owner[client] for client in range(config.data.num_clients)]


def actor_slots(config: RunConfig, cpus_free: float | None = None, costs: Sequence[float] | None = None,
                measured: Mapping[str, float] | None = None) -> list[ActorSlot]:
    """The run's ClientActors: per architecture (in config order), its clients in id order, packed by
    ``clients_per_actor`` (:func:`actor_clients`).

    An actor whose config leaves ``cpus_per_actor`` unset asks for 1 CPU, or, given the ``cpus_free`` of the
    Ray cluster (less the driver's), for an equal share of what the actors that set it leave, if that is less.
    An architecture whose ``gpus_per_actor`` is ``measured`` asks for its share in ``measured``
    (:mod:`rayfed.simulation.gpu_memory`), or for none with ``placement.executor: local``, whose actors are objects
    of the run's own process.
    """
    placement, groups = config.placement, []
    packed = actor_clients(config, costs)
    for name in architecture_names(config):
        group = config.architectures[name] if name else None
        cpus = (group.cpus_per_actor if group else None) or placement.cpus_per_actor  # None: unset
        gpus = gpu_share(config, name)
        if gpus == MEASURED:
            if measured is None or name not in measured:
                if placement.executor != "local":
                    raise ValueError(f"architecture {name!r}: its GPU share is measured, and was not given")
                gpus = 0.0
            else:
                gpus = measured[name]
        groups.append((name, [chunk for arch, chunk in packed if arch == name], cpus, gpus))
    unset = sum(len(chunks) for _, chunks, cpus, _ in groups if cpus is None)
    share = 1.0
    if unset and cpus_free is not None:
        left = cpus_free - sum(len(chunks) * cpus for _, chunks, cpus, _ in groups if cpus is not None)
        fitted = math.floor(left / unset * 10**4) / 10**4  # Ray counts CPUs in ten-thousandths
        share = min(share, fitted) if fitted > 0 else share  # nothing left: the resource check says so
    return [ActorSlot(name, chunk, share if cpus is None else cpus, gpus)
            for name, chunks, cpus, gpus in groups for chunk in chunks]


def gpu_share(config: RunConfig, name: str) -> float | str:
    """Architecture ``name``'s ``gpus_per_actor`` as configured (its own, else ``placement``'s): a number or
    ``measured``."""
    group = config.architectures[name] if name else None
    return group.gpus_per_actor if group and group.gpus_per_actor is not None else config.placement.gpus_per_actor


def actor_clients(config: RunConfig, costs: Sequence[float] | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The clients of every ClientActor with its architecture: per architecture (in config order), its clients in id
    order, packed by ``clients_per_actor``.

    With each client's ``costs`` (``placement.balance_by: cost``) there are as many actors, but shared out over the
    architectures in proportion to their clients' total cost (:func:`cost_shares`), and each architecture's clients
    are cut, in id order, into runs of about equal cost (:func:`equal_cost_runs`)."""
    of = architecture_of(config)
    chunks = {}
    for name in architecture_names(config):
        group = config.architectures[name] if name else None
        per_actor = (group.clients_per_actor if group else None) or config.placement.clients_per_actor
        ids = [client for client in range(config.data.num_clients) if of[client] == name]
        chunks[name] = [tuple(ids[i:i + per_actor]) for i in range(0, len(ids), per_actor)]
    if costs is not None:
        clients = {name: [c for chunk in parts for c in chunk] for name, parts in chunks.items()}
        shares = cost_shares({name: [costs[c] for c in ids] for name, ids in clients.items()},
                             sum(len(parts) for parts in chunks.values()))
        chunks = {name: equal_cost_runs(clients[name], costs, shares[name]) for name in chunks}
    return [(name, chunk) for name, parts in chunks.items() for chunk in parts]


def cost_shares(costs: dict[str, list[float]], actors: int) -> dict[str, int]:
    """``actors`` shared out over the groups of client ``costs`` (architectures, in order): one each, then each next
    one to the group whose actors carry the most cost each, among those with more clients than actors (ties: the
    first group). So the costliest actor carries as little as the count allows."""
    shares = dict.fromkeys(costs, 1)
    totals = {name: sum(group) for name, group in costs.items()}
    for _ in range(actors - len(costs)):
        open_groups = [name for name in costs if shares[name] < len(costs[name])]
        if not open_groups:
            break
        shares[max(open_groups, key=lambda name: totals[name] / shares[name])] += 1
    return shares


def equal_cost_runs(client_ids: list[int], costs: Sequence[float], parts: int) -> list[tuple[int, ...]]:
    """``client_ids`` cut, in order, into ``parts`` non-empty runs of about equal cost: the ``k``-th cut where the
    running cost comes nearest to ``k / parts`` of the whole (the earlier cut on a tie)."""
    running = list(itertools.accumulate(costs[c] for c in client_ids))
    cuts = [0]
    for k in range(1, parts):
        target = running[-1] * k / parts
        ends = range(cuts[-1] + 1, len(client_ids) - (parts - k) + 1)
        cuts.append(min(ends, key=lambda end: (abs(running[end - 1] - target), end)))
    cuts.append(len(client_ids))
    return [tuple(client_ids[start:end]) for start, end in zip(cuts, cuts[1:])]


def prefixed(tensors: dict[str, T], architecture: str) -> dict[str, T]:
    """``tensors`` under the server's names (``<architecture>/<name>``; unchanged for a run of one)."""
    return {prefixed_name(architecture, name): value for name, value in tensors.items()} if architecture else tensors


def unprefixed(tensors: dict[str, T] | None, architecture: str) -> dict[str, T] | None:
    """The part of server-named ``tensors`` that belongs to ``architecture``, under the client's names."""
    if tensors is None or not architecture:
        return tensors
    return {own: value for name, value in tensors.items() if (own := behind(name, architecture)) is not None}
