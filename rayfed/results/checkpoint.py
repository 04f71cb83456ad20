"""Checkpoints: safetensors for tensors, JSON for everything else; nothing is ever unpickled.

Layout, per method label::

    checkpoints/<label>/latest.json          -> {"round": R, "dir": "round_R"}
    checkpoints/<label>/round_R/meta.json     round, counters, slot names (and the paths of slots holding trees),
                                              resolved config and its fingerprint
    checkpoints/<label>/round_R/server.safetensors
    checkpoints/<label>/round_R/clients.safetensors

``latest.json`` is replaced atomically after a round's files are complete, so a crash while
writing leaves the previous checkpoint in force. A resumed run loads a checkpoint only when its
config (every method's hyperparameters included) has the checkpoint's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from rayfed import compat
from rayfed.errors import ConfigError
from rayfed.io import atomic_write_bytes, atomic_write_json
from rayfed.method import ClientState, ServerState
from rayfed.param_names import prefixed_name, split_prefix
from rayfed.state_tree import flatten_tree, nested_paths, unflatten_tree


@dataclass
class Checkpoint:
    round: int
    server: ServerState
    clients: dict[int, ClientState]
    meta: dict[str, Any]


def _flatten(slots: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every tensor of the slots under ``<slot>/<name>``, a tree's name its path joined by ``/``
    (:func:`rayfed.state_tree.flatten_tree`)."""
    return {
        prefixed_name(slot, name): value.detach().cpu().contiguous().clone()
        for slot, values in slots.items()
        for name, value in flatten_tree(values).items()
    }


def _trees(slots: dict[str, dict[str, Any]]) -> dict[str, list[list[str]]]:
    """The paths of the slots that hold trees (:func:`rayfed.state_tree.nested_paths`), recorded in meta.json."""
    return {slot: paths for slot, values in slots.items() if (paths := nested_paths(values))}


def _unflatten(flat: dict[str, torch.Tensor], slot_names: list[str],
               trees: dict[str, list[list[str]]]) -> dict[str, dict[str, Any]]:
    """The slots of a :func:`_flatten` result; a slot without recorded paths (every slot of a checkpoint written
    before trees) flat, each name as it was saved."""
    slots: dict[str, dict[str, torch.Tensor]] = {slot: {} for slot in slot_names}
    for key, value in flat.items():
        slot, name = split_prefix(key)
        slots.setdefault(slot, {})[name] = value
    return {slot: unflatten_tree(values, trees.get(slot, ())) for slot, values in slots.items()}


UNCHECKED_SECTIONS = ("placement", "ray", "tracking")
"""Config sections a fingerprint leaves out: where the actors run, and who follows the run, do not change its
numbers."""


def config_fingerprint(config: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a resolved config (``RunConfig.to_dict()``), but its
    :data:`UNCHECKED_SECTIONS`."""
    checked = {key: value for key, value in config.items() if key not in UNCHECKED_SECTIONS}
    canonical = json.dumps(checked, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


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
        client_tensors.update({prefixed_name(str(cid), key): value for key, value in _flatten(state).items()})
    atomic_write_bytes(round_dir / "server.safetensors", safetensors.torch.save(_flatten(server)))
    atomic_write_bytes(round_dir / "clients.safetensors", safetensors.torch.save(client_tensors))
    full_meta = {
        **meta,
        **({"fingerprint": config_fingerprint(meta["config"])} if "config" in meta else {}),
        "round": round_idx,
        "server_slots": sorted(server),
        "client_slots": {str(cid): sorted(state) for cid, state in clients.items()},
    }
    server_trees = _trees(server)
    client_trees = {str(cid): trees for cid, state in clients.items() if (trees := _trees(state))}
    if server_trees:
        full_meta["server_trees"] = server_trees
    if client_trees:
        full_meta["client_trees"] = client_trees
    atomic_write_json(round_dir / "meta.json", full_meta)
    atomic_write_json(method_dir / "latest.json", {"round": round_idx, "dir": round_dir.name})
    for old in method_dir.glob("round_*"):
        if old != round_dir:
            shutil.rmtree(old, ignore_errors=True)
    return round_dir


def load_checkpoint(root: Path, label: str, config: dict[str, Any] | None = None) -> Checkpoint | None:
    """The latest complete checkpoint of ``label``, or None when there is none; given the resolved ``config`` of
    the run that is to continue from it, one sentence naming a difference unless it has the checkpoint's fingerprint."""
    method_dir = Path(root) / label
    pointer = method_dir / "latest.json"
    if not pointer.is_file():
        return None
    round_dir = method_dir / _read_json(pointer)["dir"]
    meta = _read_json(round_dir / "meta.json")
    if config is not None:
        _check_config(meta, config, round_dir)
    server = _unflatten(_read_tensors(round_dir / "server.safetensors"), meta["server_slots"],
                        meta.get("server_trees", {}))
    grouped: dict[int, dict[str, torch.Tensor]] = {int(cid): {} for cid in meta["client_slots"]}
    for key, value in _read_tensors(round_dir / "clients.safetensors").items():
        cid, rest = split_prefix(key)
        grouped[int(cid)][rest] = value
    client_trees = meta.get("client_trees", {})
    clients = {cid: _unflatten(flat, meta["client_slots"][str(cid)], client_trees.get(str(cid), {}))
               for cid, flat in grouped.items()}
    return Checkpoint(meta["round"], server, clients, meta)


def latest_round(root: Path, label: str) -> int | None:
    """The round of ``label``'s latest complete checkpoint under ``root``, or None when there is none."""
    pointer = Path(root) / label / "latest.json"
    return int(_read_json(pointer)["round"]) if pointer.is_file() else None


def _check_config(meta: dict[str, Any], config: dict[str, Any], round_dir: Path) -> None:
    recorded = meta.get("config", {})
    expected = compat.checkpoint_fingerprint(meta, config_fingerprint)
    if config_fingerprint(config) == expected:
        return
    checked = [{k: v for k, v in c.items() if k not in UNCHECKED_SECTIONS} for c in (recorded, config)]
    difference = _first_difference(*checked)
    what = (f"{difference[0]} = {difference[1]!r} there, {difference[2]!r} now" if difference
            else "its config fingerprint differs")
    raise ConfigError(
        f"checkpoint {str(round_dir)!r} was written with another config ({what}), and a run never continues with "
        "settings other than its own: restore the run's config.yaml, or start a new run."
    )


_UNSET = "<unset>"


def _first_difference(then: Any, now: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first ``(field, value then, value now)`` at which two config dicts differ, or None."""
    if isinstance(then, dict) and isinstance(now, dict):
        for key in list(then) + [k for k in now if k not in then]:
            found = _first_difference(then.get(key, _UNSET), now.get(key, _UNSET), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(then, list) and isinstance(now, list) and len(then) == len(now):
        for index, (old, new) in enumerate(zip(then, now)):
            found = _first_difference(old, new, f"{path}[{index}]")
            if found:
                return found
        return None
    return None if then == now else (path, then, now)


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
