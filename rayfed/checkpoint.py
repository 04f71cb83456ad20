"""Checkpoints: safetensors for tensors, JSON for everything else; nothing is ever unpickled.

Layout, per method label::

    checkpoints/<label>/latest.json          -> {"round": R, "dir": "round_R"}
    checkpoints/<label>/round_R/meta.json     round, counters, slot names, resolved config
    checkpoints/<label>/round_R/server.safetensors
    checkpoints/<label>/round_R/clients.safetensors

``latest.json`` is replaced atomically after a round's files are complete, so a crash while
writing leaves the previous checkpoint in force.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from rayfed.errors import ConfigError
from rayfed.io import atomic_write_bytes, atomic_write_json
from rayfed.method import ClientState, ServerState

_SEP = "/"


@dataclass
class Checkpoint:
    round: int
    server: ServerState
    clients: dict[int, ClientState]
    meta: dict[str, Any]


def _flatten(slots: dict[str, dict[str, torch.Tensor]], prefix: str = "") -> dict[str, torch.Tensor]:
    return {
        f"{prefix}{slot}{_SEP}{name}": value.detach().cpu().contiguous().clone()
        for slot, values in slots.items()
        for name, value in values.items()
    }


def _unflatten(flat: dict[str, torch.Tensor], slot_names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    slots: dict[str, dict[str, torch.Tensor]] = {slot: {} for slot in slot_names}
    for key, value in flat.items():
        slot, name = key.split(_SEP, 1)
        slots.setdefault(slot, {})[name] = value
    return slots


def save_checkpoint(
    root: Path, label: str, round_idx: int, server: ServerState,
    clients: dict[int, ClientState], meta: dict[str, Any],
) -> Path:
    method_dir = Path(root) / label
    round_dir = method_dir / f"round_{round_idx}"
    if round_dir.exists():
        shutil.rmtree(round_dir)
    round_dir.mkdir(parents=True)
    client_tensors: dict[str, torch.Tensor] = {}
    for cid, state in clients.items():
        client_tensors.update(_flatten(state, prefix=f"{cid}{_SEP}"))
    atomic_write_bytes(round_dir / "server.safetensors", safetensors.torch.save(_flatten(server)))
    atomic_write_bytes(round_dir / "clients.safetensors", safetensors.torch.save(client_tensors))
    full_meta = {
        **meta,
        "round": round_idx,
        "server_slots": sorted(server),
        "client_slots": {str(cid): sorted(state) for cid, state in clients.items()},
    }
    atomic_write_json(round_dir / "meta.json", full_meta)
    atomic_write_json(method_dir / "latest.json", {"round": round_idx, "dir": round_dir.name})
    for old in method_dir.glob("round_*"):
        if old != round_dir:
            shutil.rmtree(old, ignore_errors=True)
    return round_dir


def load_checkpoint(root: Path, label: str) -> Checkpoint | None:
    """The latest complete checkpoint of ``label``, or None when there is none."""
    method_dir = Path(root) / label
    pointer = method_dir / "latest.json"
    if not pointer.is_file():
        return None
    round_dir = method_dir / _read_json(pointer)["dir"]
    meta = _read_json(round_dir / "meta.json")
    server = _unflatten(_read_tensors(round_dir / "server.safetensors"), meta["server_slots"])
    grouped: dict[int, dict[str, torch.Tensor]] = {int(cid): {} for cid in meta["client_slots"]}
    for key, value in _read_tensors(round_dir / "clients.safetensors").items():
        cid, rest = key.split(_SEP, 1)
        grouped[int(cid)][rest] = value
    clients = {cid: _unflatten(flat, meta["client_slots"][str(cid)]) for cid, flat in grouped.items()}
    return Checkpoint(meta["round"], server, clients, meta)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"checkpoint file {str(path)!r} is missing or not valid JSON ({err}).") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load_file(path)
    except (OSError, safetensors.SafetensorError) as err:
        raise ConfigError(
            f"checkpoint file {str(path)!r} is not a readable safetensors file ({err}); "
            "rayfed only loads safetensors + JSON checkpoints and never unpickles."
        ) from None
