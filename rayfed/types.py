"""Plain-tensor state shared by every layer: what clients and the server keep and send.

State is plain tensors so that it can be checkpointed as safetensors:
- ``ClientState``: named slots of tensors kept for one client between rounds (e.g. ``Slot.PERSONAL``);
- ``ServerState``: named slots kept by the server (e.g. ``Slot.GLOBAL``);
  a slot of either may hold a tree (nested dicts of named tensors, :mod:`rayfed.state_tree`);
- an upload: named slots a client sends to the server in one round (e.g. ``Slot.SHARED``).

A method may add slots of its own names; :class:`Slot` names those the engine and the default hooks read.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from enum import StrEnum
from typing import Any

import torch

from rayfed.state_tree import map_tree, tree_leaves

TensorDict = dict[str, torch.Tensor]
ClientState = dict[str, TensorDict]
ServerState = dict[str, TensorDict]
Batch = dict[str, torch.Tensor]
"""Named columns of one minibatch (``pixel_values``, ``input_ids``, ``attention_mask``, ``labels``, ...)."""
Loss = torch.Tensor | float
"""A training loss: a 0-d tensor on the training device (or a float). ``float(loss)`` reads it, waiting for the
device to finish the steps behind it; an actor reads a round's losses together after its last client, so that
the host never waits for the GPU between two clients."""


class Slot(StrEnum):
    """The slots the engine and the default hooks read. Each equals its bare string (``Slot.SHARED == "shared"``,
    the same dict key), so a method may write either; ``Slot(name)`` of any other name is refused in one sentence
    naming these."""

    SHARED = "shared"
    """Upload slot of the shared parameters: the default ``local_update`` writes it, the default ``aggregate`` and
    a ``Mixture`` read it."""
    GLOBAL = "global"
    """Server slot of the shared parameters: the default ``init_server``, ``aggregate`` and ``payload`` use it."""
    PERSONAL = "personal"
    """Client-state slot of the personal parameters: the default ``init_client``, ``local_update`` and
    ``eval_params`` use it."""
    ROWS = "stacks"
    """Server slot of a ``Mixture``'s rows, which the engine keeps: one stack per tensor (or group), a row per
    client."""

    @classmethod
    def _missing_(cls, value: object) -> Slot:
        from rayfed.errors import ConfigError

        raise ConfigError(f"{value!r} is not a rayfed slot; the slots are {', '.join(repr(s.value) for s in cls)}.")


def read_slot(slots: Mapping[str, TensorDict], slot: Slot, what: str) -> TensorDict:
    """``slots[slot]``; one sentence naming ``what`` held them (e.g. "Ditto.eval_params's client state"), the slot,
    those it has and the engine's slots when it has none of that name."""
    try:
        return slots[slot]
    except KeyError:
        from rayfed.errors import ConfigError

        held = ", ".join(repr(str(name)) for name in slots) or "none"
        raise ConfigError(f"{what} has no slot {slot.value!r} (its slots: {held}); the default hooks read the slots "
                          f"{', '.join(repr(s.value) for s in Slot)}: override the hook that reads it, or keep the "
                          "slot.") from None


class ReadOnlyTensors(dict):
    """A dict (of dicts) of host tensors that its receiver only reads: a round's payloads, an actor's partial sum.

    Through Ray (``rayfed.transport``) its tensors arrive as views of the object store's copy instead of copies of
    their own: one pass over the bytes, and over as many fresh pages, less per transfer (45 MB of payload and 90 MB
    of partial sum a round for an LLM's LoRA). In one process it is a plain dict."""


def tensor_params(tree: Any) -> int:
    """The number of parameters (elements) in a tensor or a nested dict of tensors."""
    if isinstance(tree, torch.Tensor):
        return tree.numel()
    if isinstance(tree, dict):
        return sum(tensor_params(value) for value in tree.values())
    return 0


def tensor_bytes(tree: Any) -> int:
    """The bytes of a tensor or a nested dict of tensors."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(value) for value in tree.values())
    return 0


def tensors_to(tensors: TensorDict, device: torch.device | str) -> TensorDict:
    """``tensors`` on ``device``. From a GPU to the host, the tensors of each dtype go in one copy into pinned
    memory, several times faster than a synchronous copy per tensor into pageable memory
    (``benchmarks/state_copies.py``); the results are views of that copy."""
    if torch.device(device).type != "cpu" or not any(value.is_cuda for value in tensors.values()):
        return {name: value.to(device) for name, value in tensors.items()}
    pinned = _gpu_to_pinned([value for value in tensors.values() if value.is_cuda])
    return {name: pinned.get(id(value), value) for name, value in tensors.items()}


def states_to(states: dict[Any, ClientState], device: torch.device | str) -> dict[Any, ClientState]:
    """Several clients' states on ``device``, moved together.

    Between the host and a GPU each dtype's tensors cross in one copy through pinned memory instead of one
    synchronising copy each into or from pageable memory (``benchmarks/state_copies.py``: 50 Ditto states of
    5.6 MB, 0.24 -> 0.15 s both ways on one H100 host; no gain on another), and a tensor several states share
    (the initial parameters of clients that have not trained yet) crosses once. On the host each client's tensors
    of a dtype are views of one buffer of its own, so that thousands of clients' states are freed one by one as they
    are replaced, not held by a buffer a round's clients share.
    """
    device = torch.device(device)
    owner: dict[int, Any] = {}  # id of each tensor to move -> the first state holding it
    moving: dict[int, torch.Tensor] = {}
    for key, state in states.items():
        for _, value in tree_leaves(state):  # a slot may hold a tree (rayfed.state_tree)
            if not _is_on(value, device) and id(value) not in moving:
                owner[id(value)], moving[id(value)] = key, value
    tensors = list(moving.values())
    if device.type == "cuda" and tensors and all(value.device.type == "cpu" for value in tensors):
        moved = _host_to_gpu(tensors, device)
    elif device.type == "cpu" and tensors and all(value.is_cuda for value in tensors):
        moved = _own_host_copies(_gpu_to_pinned(tensors), tensors, owner)
    else:
        moved = {id(value): value.detach().to(device) for value in tensors}
    return {key: map_tree(state, lambda value: moved.get(id(value), value)) for key, state in states.items()}


def moved_together(tensors: Iterable[torch.Tensor], device: torch.device | str,
                   copy: bool = False) -> dict[int, torch.Tensor]:
    """``tensors`` on ``device``, detached, by the ``id`` of each; those elsewhere (with ``copy``, all) copied with
    one copy per source device and dtype instead of one each, as views of one buffer per dtype on ``device``.

    To a GPU the host tensors are gathered into pinned memory and cross without the host waiting (torch's caching
    host allocator reuses the pinned blocks, and keeps each until its copy is done); one blocking copy per tensor
    from pageable memory made the host wait for the GPU once per tensor. A tensor given twice is copied once."""
    device = torch.device(device)
    tensors = list({id(value): value for value in tensors}.values())
    moving = [value for value in tensors if copy or not _is_on(value, device)]
    moved = {id(value): value.detach() for value in tensors}
    pinned = [device.type == "cuda" and value.device.type == "cpu" for value in moving]
    if any(pinned):
        moved.update(_host_to_gpu([value for value, pin in zip(moving, pinned) if pin], device))
    for group in _by_kind([value for value, pin in zip(moving, pinned) if not pin]).values():
        moved.update(_split_like(_gathered(group).to(device), group))
    return moved


def host_copies(tensors: Iterable[torch.Tensor], sent_only: Collection[int] = ()) -> dict[int, torch.Tensor]:
    """``tensors`` on the host, detached, by the ``id`` of each, each in storage of its own (pickled or kept, a
    tensor then holds only its bytes). GPU tensors cross in one copy per GPU and dtype into pinned memory with one
    wait per GPU, then are copied out of it; a host tensor viewing a larger storage is copied; others are kept.

    ``sent_only``: the ids of tensors that are only sent through Ray and read, never kept: they stay views of the
    pinned copy (or of their storage), since Ray's raw transport ships a view's own bytes (one pass less over them)."""
    tensors = list({id(value): value for value in tensors}.values())
    on_gpu = [value for value in tensors if value.is_cuda]
    pinned = _gpu_to_pinned(on_gpu) if on_gpu else {}
    copies = {}
    for value in tensors:
        source = pinned.get(id(value), value.detach())
        owns = source.device.type == "cpu" and source.untyped_storage().nbytes() == source.nbytes
        kept_as_is = id(value) in sent_only or (owns and id(value) not in pinned)
        copies[id(value)] = source if kept_as_is else _own_copy(source)
    return copies


def _own_copy(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _by_kind(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for value in tensors:
        groups.setdefault((value.device, value.dtype), []).append(value)
    return groups


def _gathered(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' values one after another in one flat tensor."""
    return torch.cat([value.detach().reshape(-1) for value in tensors], out=out)


def _split_like(flat: torch.Tensor, tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """A :func:`_gathered` tensor's parts as views shaped like ``tensors``, by the ``id`` of each."""
    parts = flat.split([value.numel() for value in tensors])
    return {id(value): part.view(value.shape) for value, part in zip(tensors, parts)}


def _host_to_gpu(tensors: list[torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    """Host tensors on the GPU: each dtype's gathered into pinned memory, then one copy without waiting."""
    moved = {}
    for (_, dtype), group in _by_kind(tensors).items():
        pinned = torch.empty(sum(value.numel() for value in group), dtype=dtype, pin_memory=True)
        on_gpu = _gathered(group, out=pinned).to(device, non_blocking=True)  # torch keeps the pinned block until done
        moved.update(_split_like(on_gpu, group))
    return moved


def _gpu_to_pinned(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """GPU tensors on the host: views of one pinned copy per GPU and dtype, made with one wait per GPU."""
    pinned_views, copied = pinned_copies(tensors)
    for done in copied:
        done.synchronize()
    return pinned_views


def pinned_copies(tensors: Iterable[torch.Tensor]) -> tuple[dict[int, torch.Tensor], list[torch.cuda.Event]]:
    """GPU tensors on the host, by the ``id`` of each: views of one pinned copy per GPU and dtype, queued on each
    GPU's current stream without waiting for it; the views hold their values once every event returned (one a GPU)
    has completed."""
    pinned_views, gpus = {}, set()
    for (gpu, dtype), group in _by_kind(list({id(value): value for value in tensors}.values())).items():
        flat = _gathered(group)
        pinned = torch.empty(flat.numel(), dtype=dtype, pin_memory=True)
        pinned.copy_(flat, non_blocking=True)
        gpus.add(gpu)
        pinned_views.update(_split_like(pinned, group))
    copied = []
    for gpu in gpus:
        copied.append(torch.cuda.Event(blocking=True))  # a thread that waits on it sleeps rather than spins a CPU
        copied[-1].record(torch.cuda.current_stream(gpu))
    return pinned_views, copied


def _own_host_copies(pinned: dict[int, torch.Tensor], tensors: list[torch.Tensor],
                     owner: dict[int, Any]) -> dict[int, torch.Tensor]:
    """The pinned views of ``tensors`` copied into one pageable buffer per owner and dtype."""
    by_owner: dict[tuple[Any, torch.dtype], list[torch.Tensor]] = {}
    for value in tensors:
        by_owner.setdefault((owner[id(value)], value.dtype), []).append(value)
    copies = {}
    for group in by_owner.values():
        copies.update(_split_like(_gathered([pinned[id(value)] for value in group]), group))
    return copies
