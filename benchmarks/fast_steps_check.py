"""One round of a method's local updates, eager against ``train.compile`` and ``train.cuda_graphs``: each mode's
seconds and how far its uploaded tensors are from the eager ones (``benchmarks/README.md``, "The seed methods on
the fast path"). Every mode builds its own in-process actor from the same config, so each trains from the same
initial values on the same batches.

    python -m rayfed.benchmarks.fast_steps_check --config configs/pfedmma/offline.yaml --label pfedmma \\
        --modes eager compile --clients 0 1 --set train.local_epochs=null train.local_steps=2 --out check.json

The first round of a mode pays its compilation or capture; the second (the same clients, the round after, from
the same payloads) is the round time reported.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from rayfed.compute import WITHOUT_MATCHING
from rayfed.stages import PreFederationStage, declared

# Each mode sets both fields: a config's own (TAP's offline configs turn CUDA graphs on) must not leak into another.
MODES = {"eager": {"compile": False, "cuda_graphs": False}, "compile": {"compile": True, "cuda_graphs": False},
         "cuda_graphs": {"compile": False, "cuda_graphs": True},
         "compile+cuda_graphs": {"compile": True, "cuda_graphs": True}}
Uploads = dict[int, dict[str, dict[str, torch.Tensor]]]


def method_overrides(config: Path, label: str) -> list[str]:
    """The override that keeps only method ``label`` of ``config`` (a JSON method entry: that method instead)."""
    if label.startswith("{"):
        return [f"methods=[{label}]", WITHOUT_MATCHING]
    methods = yaml.safe_load(config.read_text())["methods"]
    chosen = [m for m in methods if (m if isinstance(m, str) else m.get("label", m["name"])) == label]
    if not chosen:
        raise SystemExit(f"--label {label!r} is not a method label of {config}")
    return [f"methods={json.dumps(chosen[:1])}", WITHOUT_MATCHING]


def round_uploads(config: Path | dict, overrides: Sequence[str], clients: Sequence[int], mode: str,
                  rounds: int = 1) -> tuple[Uploads, dict[str, torch.Tensor], list[float]]:
    """The uploads of ``clients``' first local updates (on one in-process actor of their architecture) under
    ``mode``, the model's initial trainable values, and the seconds of each of ``rounds`` rounds (every later round
    from the same payloads)."""
    from rayfed.actors.client import ClientActor
    from rayfed.actors.driver import DriverActor
    from rayfed.architectures import architecture_of
    from rayfed.config import load_config

    settings = [f"train.{field}={json.dumps(value)}" for field, value in MODES[mode].items()]
    raw = load_config(config, [*overrides, "placement.executor=local", *settings]).to_dict()
    owners = architecture_of(load_config(raw))
    architecture = owners[clients[0]]
    actor = ClientActor(raw, list(clients), architecture=architecture)
    # One actor per other architecture, for the server's initial state and a pre-federation stage (an alignment).
    names = list(dict.fromkeys(owners))
    actors = [actor if name == architecture else ClientActor(raw, [owners.index(name)], architecture=name)
              for name in names]
    initial = [each.start_method(0) for each in actors]
    driver = DriverActor(raw)
    driver.start_method(0, names, *initial, *(each.task_tags() for each in actors))
    if declared(actor.method, PreFederationStage):
        driver.before_federation(names, *(each.pre_federation(0) for each in actors))
    payloads = driver.payloads(list(clients))
    uploads: Uploads = {}
    seconds = []
    for round_idx in range(rounds):
        start = time.perf_counter()
        done = actor.train(round_idx, list(clients), payloads)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        if round_idx == 0:  # with what each client keeps (its personal values, ...)
            uploads = {upload.client_id: {**upload.tensors, **_kept_tensors(actor.states[upload.client_id])}
                       for upload in done}
    return uploads, {name: value.cpu() for name, value in actor.initial_params.items()}, seconds


def _kept_tensors(state: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    return {f"kept:{slot}": {name: value.cpu() for name, value in values.items() if isinstance(value, torch.Tensor)}
            for slot, values in state.items() if isinstance(values, dict)}


def largest_relative_difference(reference: Uploads, other: Uploads, initial: dict[str, torch.Tensor]) -> float:
    """Over the clients, ``|other - reference|`` over the size of what the update changed, ``|reference - initial|``
    (``initial`` by name; zero for a tensor that is no parameter), norms over every floating tensor a client uploaded
    or kept, together: a tensor whose whole update is round-off (a gradient that is zero but for rounding) cannot
    decide alone. Inf where a tensor is missing, has another shape, or an integer tensor differs."""
    worst = 0.0
    for cid, slots in reference.items():
        gap = size = 0.0
        for slot, tensors in slots.items():
            for name, value in tensors.items():
                theirs = other.get(cid, {}).get(slot, {}).get(name)
                if theirs is None or theirs.shape != value.shape:
                    return math.inf
                if not value.is_floating_point():
                    if not torch.equal(value, theirs):
                        return math.inf
                    continue
                gap += float((theirs.double() - value.double()).norm()) ** 2
                size += _moved(value, initial.get(name)) ** 2
        worst = max(worst, math.sqrt(gap / size) if gap else 0.0)
    return worst


def largest_update(uploads: Uploads, initial: dict[str, torch.Tensor]) -> float:
    """Over the clients, ``|update| / |initial values|`` of the parameters a client uploaded or kept (norms over all
    of them together): how far training moved them."""
    worst = 0.0
    for slots in uploads.values():
        pairs = [(value, initial[name]) for tensors in slots.values() for name, value in tensors.items()
                 if name in initial and value.is_floating_point() and initial[name].shape == value.shape]
        moved = math.sqrt(sum(_moved(value, start) ** 2 for value, start in pairs))
        size = math.sqrt(sum(float(start.double().norm()) ** 2 for _, start in pairs))
        worst = max(worst, moved / size if size else 0.0)
    return worst


def _moved(value: torch.Tensor, start: torch.Tensor | None) -> float:
    if start is None or start.shape != value.shape:
        return 0.0
    return float((value.double() - start.double()).norm())


def compiled_gap(config: Path | dict, clients: Sequence[int] = (0,), mode: str = "compile",
                 overrides: Sequence[str] = ()) -> tuple[float, float]:
    """:func:`largest_relative_difference` of ``clients``' first uploads under ``mode`` from the eager ones, and the
    eager update's :func:`largest_update`."""
    eager, initial, _ = round_uploads(config, overrides, clients, "eager")
    other, _, _ = round_uploads(config, overrides, clients, mode)
    return largest_relative_difference(eager, other, initial), largest_update(eager, initial)


def compare_modes(config: Path, label: str, modes: Sequence[str], clients: Sequence[int], overrides: Sequence[str],
                  rounds: int, out: Path | None = None) -> dict[str, Any]:
    """Each mode's round seconds and its uploads' largest difference from the first mode's, relative to the update;
    written to ``out`` after each mode (a run stopped by a time limit keeps what it measured)."""
    every = [*method_overrides(config, label), *overrides]
    results: dict[str, Any] = {"config": str(config), "label": label, "clients": list(clients), "overrides": every}
    reference: Uploads | None = None
    for mode in modes:
        try:
            uploads, initial, seconds = round_uploads(config, every, clients, mode, rounds)
        except Exception as err:  # a mode that fails is a result of the check, not its end
            row: dict[str, Any] = {"error": f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"}
        else:
            row = {"round_seconds": seconds}
            if reference is None:
                reference = uploads
            else:
                row["largest_relative_difference"] = largest_relative_difference(reference, uploads, initial)
        results[mode] = row
        print(mode, row, flush=True)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--label", required=True, help="the method's label in the config, or a JSON method entry")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["eager", "compile"])
    parser.add_argument("--clients", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from torch._inductor import config as inductor_config

    with inductor_config.patch(compile_threads=1 if not torch.cuda.is_available() else inductor_config.compile_threads):
        compare_modes(args.config, args.label, args.modes, args.clients, args.overrides, args.rounds, args.out)


if __name__ == "__main__":
    main()
