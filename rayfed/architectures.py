"""Clients of different architectures in one run (``architectures:`` in the config).

Every client has one architecture (a backbone and model config); a ClientActor hosts clients of one
architecture only, and the server keeps one initial state per architecture. The server sees each
parameter name prefixed by its architecture (``small/<name>``), so a per-tensor rule such as FedAvg
aggregates within an architecture; a client sends and receives its own architecture's names as they
are. A run without ``architectures:`` has one architecture, ``""``, and no prefixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from rayfed.config import RunConfig

T = TypeVar("T")
SEP = "/"


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


def actor_slots(config: RunConfig, cpus_free: float | None = None) -> list[ActorSlot]:
    """The run's ClientActors: per architecture (in config order), its clients in id order, packed by
    ``clients_per_actor``.

    An actor whose config leaves ``cpus_per_actor`` unset asks for 1 CPU, or, given the ``cpus_free`` of the
    Ray cluster (less the driver's), for an equal share of what the actors that set it leave, if that is less.
    """
    placement, groups = config.placement, []
    of = architecture_of(config)
    for name in architecture_names(config):
        group = config.architectures[name] if name else None
        per_actor = (group.clients_per_actor if group else None) or placement.clients_per_actor
        cpus = (group.cpus_per_actor if group else None) or placement.cpus_per_actor  # None: unset
        gpus = group.gpus_per_actor if group and group.gpus_per_actor is not None else placement.gpus_per_actor
        ids = [client for client in range(config.data.num_clients) if of[client] == name]
        groups.append((name, [tuple(ids[i:i + per_actor]) for i in range(0, len(ids), per_actor)], cpus, gpus))
    unset = sum(len(chunks) for _, chunks, cpus, _ in groups if cpus is None)
    share = 1.0
    if unset and cpus_free is not None:
        left = cpus_free - sum(len(chunks) * cpus for _, chunks, cpus, _ in groups if cpus is not None)
        fitted = math.floor(left / unset * 10**4) / 10**4  # Ray counts CPUs in ten-thousandths
        share = min(share, fitted) if fitted > 0 else share  # nothing left: the resource check says so
    return [ActorSlot(name, chunk, share if cpus is None else cpus, gpus)
            for name, chunks, cpus, gpus in groups for chunk in chunks]


def prefixed(tensors: dict[str, T], architecture: str) -> dict[str, T]:
    """``tensors`` under the server's names (``<architecture>/<name>``; unchanged for a run of one)."""
    return {f"{architecture}{SEP}{name}": value for name, value in tensors.items()} if architecture else tensors


def unprefixed(tensors: dict[str, T] | None, architecture: str) -> dict[str, T] | None:
    """The part of server-named ``tensors`` that belongs to ``architecture``, under the client's names."""
    if tensors is None or not architecture:
        return tensors
    start = f"{architecture}{SEP}"
    return {name[len(start):]: value for name, value in tensors.items() if name.startswith(start)}
