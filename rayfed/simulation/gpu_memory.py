"""``gpus_per_actor: measured``: an architecture's GPU share from its actors' measured peak memory.

Before the actors start, a probe on one whole GPU builds the ClientActor that would host the architecture's
costliest slot (the most clients, or the most cost with ``placement.balance_by: cost``), plus, for each distinct set
of tasks among the architecture's clients, its client with the most training samples (a round's balanced clients
train on any actor of their architecture, so the largest batches of every task may meet on one). For each of the
run's methods it runs the method's pre-federation stage, a local update of :data:`PROBE_STEPS` steps of every
hosted client (the real actor code, as a plain object), an evaluation of every hosted client, and the end of run
(post-FL stage and final evaluation) of the hosted client with the largest samples (bytes a training sample), and
reads the allocator's peak (``torch.cuda.max_memory_reserved``). The probe's driver sees the run's other
architectures as zeros of their shared parameters' shapes (:func:`stand_in_start`), so that a method mixing
parameters across architectures starts; a pre-federation stage then runs on the probed actor alone, its
server side needing every architecture's result. The share is
``(peak + placement.memory_headroom_gib) / the GPU's memory``, rounded up to :data:`SHARE_STEP`.

A measurement is kept under a key of what sets an actor's memory (:func:`memory_key`) in a JSON file
(:data:`CACHE_FILE`, in the run's or the sweep's folder), so a resumed run or a sweep's trials measure nothing again.
Float hyperparameters of the methods and of ``train`` (rates, weights, margins, temperatures) are taken to leave
memory as it is, so a sweep over them is measured once; ``federation``, the run's name and the Ray settings do too.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
import torch

from rayfed import registry
from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.architectures import ActorSlot, actor_clients, architecture_names, architecture_of, gpu_share
from rayfed.config import RunConfig, architecture_model_config, method_model_config, model_configs
from rayfed.config.sections import MEASURED
from rayfed.data.clients import Federation, build_federation
from rayfed.errors import ConfigError
from rayfed.io import atomic_write_json
from rayfed.method import Method, method_model
from rayfed.models import build_backbone
from rayfed.run_methods import run_methods
from rayfed.simulation.placement import fitted_slots
from rayfed.simulation.ray_setup import import_plugin_modules, ship_by_value, unwrap_actor_error
from rayfed.stages import PreFederationStage, declared
from rayfed.types import TensorDict
from rayfed.version import __version__

PROBE_STEPS = 2
"""Steps of each probed local update: the second runs with the optimizer's state allocated by the first."""
SHARE_STEP = 0.01
"""A measured share is a multiple of this (Ray accepts GPU shares to 0.0001)."""
CACHE_FILE = "gpu_memory.json"
NO_GPU = (f"placement.gpus_per_actor: {MEASURED} needs a GPU to measure an actor's memory on, and {{where}} has none; "
          "set it to a number (0: the actors train on CPUs).")


@dataclass(frozen=True)
class Measurement:
    """One probe: the clients its actor hosted, its peak memory, and the GPU it ran on."""

    clients: tuple[int, ...]
    peak_bytes: int
    gpu_name: str
    gpu_bytes: int

    def share(self, headroom_gib: float) -> float:
        """The GPU share an actor asks for: (peak + headroom) / the GPU's memory, rounded up to :data:`SHARE_STEP`."""
        steps = math.ceil(round((self.peak_bytes + headroom_gib * 2**30) / self.gpu_bytes / SHARE_STEP, 6))
        return round(steps * SHARE_STEP, 6)


Probe = Callable[[RunConfig, str, tuple[int, ...]], Measurement]
"""Measures architecture ``name``'s actor hosting a slot's clients (:func:`probe_on_gpu`; tests give their own)."""


class GpuMemory:
    """Measurements by :func:`memory_key`, kept in ``path`` (JSON) when given and its folder exists (else at
    :meth:`save`); ``probe`` measures a missing one."""

    def __init__(self, path: str | Path | None = None, probe: Probe | None = None):
        self.path = None if path is None else Path(path)
        self.probe = probe or probe_on_gpu
        self.entries: dict[str, Measurement] = _read(self.path) if self.path is not None else {}

    def measure(self, config: RunConfig, costs: Sequence[float] | None = None) -> dict[str, dict[str, Any]]:
        """Per architecture whose ``gpus_per_actor`` is ``measured``: its share (``gpus_per_actor``) and what it came
        from, measured now unless measured before."""
        records = {}
        for name, slot in costliest_slots(config, costs).items():
            key = memory_key(config, name, slot)
            if key not in self.entries:
                self.entries[key] = self.probe(config, name, slot)
                if self.path is not None and self.path.parent.is_dir():
                    self.save()
            records[name] = _record(config, name, slot, key, self.entries[key])
        return records

    def save(self) -> None:
        """Write the measurements, if any, to ``path`` (its folder must exist)."""
        if self.path is not None and self.entries:
            atomic_write_json(self.path, {key: asdict(entry) for key, entry in self.entries.items()})

    def shares(self, config: RunConfig, costs: Sequence[float] | None = None) -> dict[str, float]:
        """Per measured architecture, its GPU share (see :meth:`measure`)."""
        return {name: record["gpus_per_actor"] for name, record in self.measure(config, costs).items()}


def _record(config: RunConfig, name: str, slot: tuple[int, ...], key: str, entry: Measurement) -> dict[str, Any]:
    headroom = config.placement.memory_headroom_gib
    share = entry.share(headroom)
    need_gib, gpu_gib = entry.peak_bytes / 2**30 + headroom, entry.gpu_bytes / 2**30
    if share > 1:
        raise ConfigError(
            f"placement.gpus_per_actor: {MEASURED}: an actor of {_named(name)} hosting "
            f"{len(slot)} clients needs {need_gib:.1f} GiB (a peak of {entry.peak_bytes / 2**30:.1f} GiB + "
            f"{headroom:g} GiB of placement.memory_headroom_gib) but the GPU ({entry.gpu_name}) has {gpu_gib:.1f} GiB; "
            "lower clients_per_actor or train.batch_size (raising train.grad_accum), or set "
            "placement.client_state: host."
        )
    return {"gpus_per_actor": share, "peak_gib": round(entry.peak_bytes / 2**30, 3), "headroom_gib": headroom,
            "gpu": entry.gpu_name, "gpu_gib": round(gpu_gib, 3), "actor_clients": list(slot),
            "probed_clients": list(entry.clients), "key": key}


def _named(name: str) -> str:
    return f"architecture {name!r}" if name else "the run's architecture"


def _read(path: Path) -> dict[str, Measurement]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        return {key: Measurement(tuple(int(c) for c in entry["clients"]), int(entry["peak_bytes"]),
                                 str(entry["gpu_name"]), int(entry["gpu_bytes"])) for key, entry in raw.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"{path} is not a file of GPU memory measurements rayfed wrote; delete it to measure "
                          "again.") from None


def measures_memory(config: RunConfig) -> bool:
    """Whether some architecture's ``gpus_per_actor`` is ``measured``."""
    return any(gpu_share(config, name) == MEASURED for name in architecture_names(config))


def costliest_slots(config: RunConfig, costs: Sequence[float] | None = None) -> dict[str, tuple[int, ...]]:
    """Per architecture whose ``gpus_per_actor`` is ``measured``, the clients of its costliest actor: the most cost
    (``costs``, see :func:`rayfed.simulation.placement.planned_costs`), else the most clients; the first on a tie."""
    slots: dict[str, tuple[int, ...]] = {}
    for name, clients in actor_clients(config, costs):
        if gpu_share(config, name) != MEASURED:
            continue
        size = (lambda ids: sum(costs[c] for c in ids)) if costs is not None else len
        if name not in slots or size(clients) > size(slots[name]):
            slots[name] = clients
    return slots


def memory_key(config: RunConfig, name: str, slot: tuple[int, ...]) -> str:
    """What sets the memory of architecture ``name``'s actor hosting ``slot``: the config without the fields that
    do not (see the module's docstring), the slot, the kind of GPU and rayfed's version; hashed."""
    raw = config.to_dict()
    placement = raw["placement"]
    kept = {key: value for key, value in raw.items() if key not in ("name", "tune", "federation", "ray")}
    kept["placement"] = {key: placement[key] for key in ("clients_per_actor", "balance_by", "client_state")}
    kept["train"] = {key: value for key, value in raw["train"].items()
                     if not _is_float(value) and key not in ("local_steps", "local_epochs")}
    kept["methods"] = [{**entry, "params": {key: value for key, value in entry["params"].items()
                                            if not _is_float(value)}} for entry in raw["methods"]]
    described = {"config": kept, "architecture": name, "slot": list(slot), "gpu": _gpu_kind(), "rayfed": __version__}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _is_float(value: Any) -> bool:
    return isinstance(value, float) or (isinstance(value, list) and bool(value)
                                        and all(isinstance(item, float) for item in value))


def _gpu_kind() -> str:
    """The GPUs' kind: the Ray cluster's accelerator types, else this process's GPU ("" without either)."""
    if ray.is_initialized():
        return ",".join(sorted(key for key in ray.cluster_resources() if key.startswith("accelerator_type:")))
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""


def probe_on_gpu(config: RunConfig, name: str, slot: tuple[int, ...]) -> Measurement:
    """:func:`peak_memory` on a whole GPU: as a Ray task (in a process of its own, so the driver needs no GPU) when
    Ray is running, else in this process."""
    plugins = registry.user_entries()
    if ray.is_initialized():
        if ray.cluster_resources().get("GPU", 0.0) < 1:
            raise ConfigError(NO_GPU.format(where="the Ray cluster"))
        ship_by_value([config, *(entry.obj for entry in plugins)])
        task = ray.remote(num_gpus=1, max_calls=1)(peak_memory)  # max_calls: a fresh process, nothing held before
        try:
            return ray.get(task.remote(config, name, slot, plugins))
        except ray.exceptions.RayTaskError as err:
            raise unwrap_actor_error(err) from None
    if not torch.cuda.is_available():
        raise ConfigError(NO_GPU.format(where="this process (Ray is not running)"))
    return peak_memory(config, name, slot, plugins)


def probe_clients(config: RunConfig, num_train: Mapping[int, int], tasks_of: Mapping[int, tuple[int, ...]],
                  name: str, slot: tuple[int, ...]) -> tuple[int, ...]:
    """The clients the probe's actor hosts: ``slot``, and for each distinct set of tasks among architecture
    ``name``'s clients the one with the most training samples (the first on a tie)."""
    largest: dict[tuple[int, ...], int] = {}
    for client, owner in enumerate(architecture_of(config)):
        if owner == name:
            tasks = tasks_of[client]
            if tasks not in largest or num_train[client] > num_train[largest[tasks]]:
                largest[tasks] = client
    return tuple(sorted({*slot, *largest.values()}))


def peak_memory(config: RunConfig, name: str, slot: tuple[int, ...],
                plugins: Sequence[registry.Entry] = ()) -> Measurement:
    """The peak GPU memory of architecture ``name``'s actor hosting ``slot`` (see the module's docstring), measured
    on this process's GPU."""
    registry.install(plugins)
    import_plugin_modules(config)
    federation = build_federation(config.data, config.seed, model_configs(config))
    num_train = {c: federation.sizes(c)["num_train"] for c in range(federation.num_clients)}
    hosted = list(probe_clients(config, num_train, {c: federation.tasks_of(c) for c in num_train}, name, slot))
    methods = run_methods(config, federation)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    actor = ClientActor(config, hosted, methods, plugins, name, federation)
    driver = DriverActor(config, methods, plugins)
    heaviest = max(hosted, key=lambda c: (actor.data[c].nbytes / max(1, num_train[c]), -c))  # the largest samples
    others = [other for other in architecture_names(config) if other != name]
    for index, method in enumerate(methods):
        initial = actor.start_method(index)
        actor.train_config = actor.train_config.model_copy(update={"local_steps": PROBE_STEPS, "local_epochs": None})
        stand_ins = [stand_in_start(config, federation, methods, index, other) for other in others]
        driver.start_method(index, [name, *others], initial, *(shared for shared, _ in stand_ins), actor.task_tags(),
                            *(tags for _, tags in stand_ins))
        if declared(method, PreFederationStage):
            prepared = actor.pre_federation(index)
            if not others:  # the server's side needs every architecture's result; the probe hosts one
                driver.before_federation([name], prepared)
        actor.train(0, hosted, driver.payloads(hosted, False))
        actor.evaluate(0, driver.payloads(hosted, False))
        actor.client_ids = [heaviest]  # the end of run (post-FL stage, final evaluation) for one client alone
        actor.finish(0, driver.payloads([heaviest], False), config.methods[index].post_train_steps)
        actor.client_ids = hosted
    torch.cuda.synchronize()
    gpu = torch.cuda.get_device_properties(actor.device)
    peak = torch.cuda.max_memory_reserved(actor.device)
    return Measurement(tuple(hosted), int(peak), gpu.name, int(gpu.total_memory))


def stand_in_start(config: RunConfig, federation: Federation, methods: Sequence[Method], index: int,
                   name: str) -> tuple[TensorDict, dict[str, Any]]:
    """Architecture ``name``'s initial shared parameters of method ``index`` as zeros (its model built on the meta
    device where its backbone allows) and its task tags: what the probe's driver needs of an architecture the probe
    does not host, for a method that mixes parameters across architectures."""
    entry = config.methods[index]
    model_config = method_model_config(architecture_model_config(config, name), entry, index)
    model = method_model(methods[index], f"methods[{index}] ({entry.label})", build_backbone(model_config, 0, "meta"),
                         model_config, federation.tasks, 0)
    shared, _ = methods[index].split(dict(model.trainable_params()))
    return {key: torch.zeros(value.shape, dtype=value.dtype) for key, value in shared.items()}, model.task_tags()


def fitted_slots_measured(config: RunConfig, costs: Sequence[float] | None,
                          run_dir: Path) -> tuple[list[ActorSlot], dict[str, dict]]:
    """The run's slots fitted to the Ray cluster, and the measured GPU shares kept for summary.json. A ``measured``
    share is measured here (or read from the run folder's cache), or, in a Ray Tune trial, given by its bundle."""
    measured = [name for name in architecture_names(config) if gpu_share(config, name) == MEASURED]
    in_trial = ray.util.get_current_placement_group() is not None
    gpu_memory: dict[str, dict] = {}
    if measured and not in_trial:
        gpu_memory = GpuMemory(run_dir / CACHE_FILE if run_dir.is_dir() else None).measure(config, costs)
    slots = fitted_slots(config, costs, {name: record["gpus_per_actor"] for name, record in gpu_memory.items()})
    if measured and in_trial:
        gpu_memory = {slot.architecture: {"gpus_per_actor": slot.gpus, "from": "the trial's placement group"}
                      for slot in slots if slot.architecture in measured}
    return slots, gpu_memory
