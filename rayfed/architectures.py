"""Clients of different architectures in one run (``architectures:`` in the config).

Every client has one architecture (a backbone and model config); a ClientActor hosts clients of one
architecture only, and the server keeps one initial state per architecture. The server sees each
parameter name prefixed by its architecture (``small/<name>``), so a per-tensor rule such as FedAvg
aggregates within an architecture; a client sends and receives its own architecture's names as they
are. A run without ``architectures:`` has one architecture, ``""``, and no prefixes.
"""

from __future__ import annotations

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


def actor_slots(config: RunConfig) -> list[ActorSlot]:
    """The run's ClientActors: per architecture (in config order), its clients in id order, packed by
    ``clients_per_actor``."""
    placement, slots = config.placement, []
    of = architecture_of(config)
    for name in architecture_names(config):
        group = config.architectures[name] if name else None
        per_actor = (group.clients_per_actor if group else None) or placement.clients_per_actor
        cpus = (group.cpus_per_actor if group else None) or placement.cpus_per_actor
        gpus = group.gpus_per_actor if group and group.gpus_per_actor is not None else placement.gpus_per_actor
        ids = [client for client in range(config.data.num_clients) if of[client] == name]
        slots += [ActorSlot(name, tuple(ids[i:i + per_actor]), cpus, gpus) for i in range(0, len(ids), per_actor)]
    return slots


def prefixed(tensors: dict[str, T], architecture: str) -> dict[str, T]:
    """``tensors`` under the server's names (``<architecture>/<name>``; unchanged for a run of one)."""
    return {f"{architecture}{SEP}{name}": value for name, value in tensors.items()} if architecture else tensors


def unprefixed(tensors: dict[str, T] | None, architecture: str) -> dict[str, T] | None:
    """The part of server-named ``tensors`` that belongs to ``architecture``, under the client's names."""
    if tensors is None or not architecture:
        return tensors
    start = f"{architecture}{SEP}"
    return {name[len(start):]: value for name, value in tensors.items() if name.startswith(start)}
