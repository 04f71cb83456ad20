"""`rayfed bench --workload tap|feddat|fedmosaic|pfedmma|fedyolo`: a seed paper's method at its paper's model size
(the paper config's offline twin: randomly initialised backbones of the paper's sizes on synthetic data of the
paper's shapes, docs/offline_models.md), each of rayfed's rounds paired with the same round of the ideal.

The ideal runs the same method's code in one plain process: the run's DriverActor and one ClientActor per
architecture as plain objects (no Ray, no actors of their own, no guests), each round's payloads, the round's
clients' local updates, the aggregation and the method's public passes called one after another, as a
hand-written single-GPU script of the method would. Each of its rounds runs right after rayfed's same round
(the hosts drift by tens of percent within minutes). overhead ratio = rayfed's s/round / the ideal's. With
``ideal_apart`` (``--ideal-apart``) the ideal runs all its rounds first and is released (its models, data and GPU
memory) before rayfed's run starts, for a GPU that cannot hold both; the rounds are then not interleaved.

The breakdown of a round names where the time goes: the clients' local updates (the ideal's, and the busiest of
rayfed's actors), the method's server hooks (payloads, aggregation, public passes: RELA's weights, alignment,
distillation on public data) and rayfed's time around its actors; the evaluation of every client (rayfed's
end-of-run evaluation, the ideal's one evaluation); the host syncs of one local update (CUDA only); peak GPU memory
of one client's update and of each actor. TFLOP/s is a local update's FLOPs (torch's counter: matrix products and
attention, KD teachers included) times the round's updates, over the ideal's client time; next to it, the same
rate of a plain LoRA FedAvg step on the same backbone and batch (``--reference``).
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
import torch
import yaml

from rayfed.actors.client import ClientActor, run_methods
from rayfed.actors.driver import DriverActor
from rayfed.architectures import actor_clients, architecture_of
from rayfed.benchmarks.mfu import mfu, mfu_cell, mfu_footnote, this_gpu_peak
from rayfed.benchmarks.overhead import synchronize
from rayfed.benchmarks.time_to_result import (first_round_setup, first_round_setup_markdown, paper_schedule, sweep_size,
                                             time_to_result, time_to_result_markdown)
from rayfed.benchmarks.update_profile import profile_local_update
from rayfed.compute import WITHOUT_MATCHING
from rayfed.config import RunConfig, load_config
from rayfed.data.clients import build_federation
from rayfed.errors import ConfigError, choice_error
from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.results.report import format_table
from rayfed.simulation import Simulation, import_plugin_modules
from rayfed.stages import PreFederationStage, declared, public_pass_count
from rayfed.system import plan_round
from rayfed.tasks import sample_round
from rayfed.training import local_steps

REPO = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the actors of this process train


@dataclass(frozen=True)
class MethodWorkload:
    """A seed method's bench: method ``label`` of ``config`` (its paper config's offline twin, a path from the
    repository's root); ``smoke_config`` / ``smoke_label``: the same method on its tiny offline config, a size a
    CPU runs in seconds (``--smoke``); ``sweep``: the tune config of the paper's named sweep, whose trials per
    GPU-hour the bench estimates (None: the paper names none)."""

    config: str
    label: str
    smoke_config: str
    smoke_label: str
    rounds: int = 3
    sweep: str | None = None


METHOD_WORKLOADS: dict[str, MethodWorkload] = {
    "tap": MethodWorkload("configs/tap/paper_flava_offline.yaml", "TAP", "configs/tap/offline_flava_quick.yaml", "TAP",
                          sweep="configs/tune/tap_margins.yaml"),
    "feddat": MethodWorkload("configs/feddat/paper_domain_offline.yaml", "FedDAT", "configs/feddat/offline_domain.yaml",
                             "FedDAT", sweep="configs/tune/feddat_kd.yaml"),
    "fedmosaic": MethodWorkload("configs/fedmosaic/paper_drake_static_offline.yaml", "fedmosaic",
                                "configs/fedmosaic/offline_static.yaml", "fedmosaic",
                                sweep="configs/tune/fedmosaic_tau_blocks.yaml"),
    "pfedmma": MethodWorkload("configs/pfedmma/cifar100_offline.yaml", "pfedmma", "configs/pfedmma/offline.yaml",
                              "pfedmma", sweep="configs/tune/pfedmma_alpha.yaml"),
    "fedyolo": MethodWorkload("configs/fedyolo/paper_fedyolo_B_tasks01_offline.yaml", "fedyolo",
                              "configs/fedyolo/offline_multitask.yaml", "fedyolo"),
}


def workload_config(workload: MethodWorkload, rounds: int, smoke: bool = False,
                    overrides: tuple[str, ...] = ()) -> RunConfig:
    """The workload's method alone, ``rounds`` rounds, evaluated once at the end, no checkpoints; then
    ``overrides`` (``key=value``, as ``rayfed run --set``)."""
    path = REPO / (workload.smoke_config if smoke else workload.config)
    label = workload.smoke_label if smoke else workload.label
    if not path.is_file():
        raise ConfigError(f"the bench's config {str(path)!r} does not exist; run the bench from a checkout of the "
                          "repository (pip install -e .).")
    methods = yaml.safe_load(path.read_text())["methods"]
    chosen = [m for m in methods if (m if isinstance(m, str) else m.get("label", m["name"])) == label]
    if not chosen:
        raise ConfigError(f"{path}: no method is labelled {label!r}.")
    return load_config(path, [f"federation.rounds={rounds}", f"federation.eval_every={rounds + 1}",
                              "federation.checkpoint_every=0", f"methods={json.dumps(chosen)}", WITHOUT_MATCHING,
                              *overrides])


def _timed(work: Callable[[], Any]) -> tuple[Any, float]:
    synchronize(DEVICE)
    started = time.perf_counter()
    result = work()
    synchronize(DEVICE)
    return result, time.perf_counter() - started


class MethodLoop:
    """The ideal: the run's method in this process, one ClientActor per architecture hosting all its clients."""

    def __init__(self, config: RunConfig):
        import_plugin_modules(config)
        self.config = config
        federation = build_federation(config.data, config.seed)
        methods = run_methods(config, federation)
        self.method = methods[0]
        self.architecture_of = architecture_of(config)
        one_actor = config.model_copy(update={"placement": config.placement.model_copy(
            update={"clients_per_actor": config.data.num_clients})})
        self.hosts = {name: ClientActor(config, client_ids, methods, (), name, federation)
                      for name, client_ids in actor_clients(one_actor)}
        self.driver = DriverActor(config, methods)
        names = list(self.hosts)
        initial = [host.start_method(0) for host in self.hosts.values()]
        self.driver.start_method(0, names, *initial, *(host.task_tags() for host in self.hosts.values()))
        if declared(self.method, PreFederationStage):
            self.driver.before_federation(names, *(host.pre_federation(0) for host in self.hosts.values()))
        self.num_train = {cid: federation.sizes(cid)["num_train"] for cid in range(federation.num_clients)}

    def round_clients(self, round_idx: int) -> dict[str, list[int]]:
        """The clients rayfed's round ``round_idx`` trains, per architecture."""
        sampled = self.method.participants(round_idx, sample_round(self.config, round_idx),
                                           self.config.data.num_clients)
        plan = plan_round(self.config, round_idx, sampled, self.num_train)
        self._weight_scale = plan.weight_scale
        return {name: [cid for cid in plan.participants if self.architecture_of[cid] == name] for name in self.hosts}

    def run_round(self, round_idx: int) -> dict[str, float]:
        """Round ``round_idx`` of the method; seconds of its parts and of the whole."""
        clients = {name: cids for name, cids in self.round_clients(round_idx).items() if cids}
        payloads, payload_s = _timed(lambda: {name: self.driver.payloads(cids) for name, cids in clients.items()})
        parts, update_s = _timed(lambda: [
            self.hosts[name].train_round(round_idx, cids, payloads[name], {c: self._weight_scale[c] for c in cids})
            for name, cids in clients.items()])
        _, aggregate_s = _timed(lambda: self.driver.aggregate(*parts))
        _, public_s = _timed(lambda: self._public_passes(round_idx))
        server_s = payload_s + aggregate_s + public_s
        return {"clients": sorted(c for cids in clients.values() for c in cids),
                "round_s": update_s + server_s, "update_s": update_s, "server_s": server_s, "payload_s": payload_s,
                "aggregate_s": aggregate_s, "public_pass_s": public_s}

    def _public_passes(self, round_idx: int) -> None:
        names = list(self.hosts)
        for index in range(public_pass_count(self.method)):
            results = [self.hosts[name].public_pass(0, round_idx, index, self.driver.public_request(index, name))
                       for name in names]
            self.driver.after_public_pass(index, names, *results)

    def evaluation_s(self, round_idx: int) -> float:
        """Seconds to evaluate every client once, as after round ``round_idx``."""
        return _timed(lambda: [host.evaluate(round_idx, self.driver.payloads(host.client_ids, False))
                               for host in self.hosts.values()])[1]

    def models(self) -> list[weakref.ref]:
        """Weak references to what holds most of the ideal's memory: each host's backbone and method model."""
        return [weakref.ref(module) for host in self.hosts.values() for module in (host.backbone.encoder, host.model)]

    def first_client(self, round_idx: int) -> tuple[str, int]:
        """The architecture and id of the client whose update the bench counts: round ``round_idx``'s first client
        of its first architecture."""
        name, cids = next((n, c) for n, c in self.round_clients(round_idx).items() if c)
        return name, cids[0]

    def update_profile(self, round_idx: int) -> dict[str, Any]:
        """One client's local update (:meth:`first_client`): its FLOPs, the host syncs
        it makes (CUDA: torch's sync debug mode, one warning a sync), its peak GPU memory above what was held."""
        name, cid = self.first_client(round_idx)
        host = self.hosts[name]
        payloads = self.driver.payloads([cid], False)
        state = host.states[cid]
        steps = local_steps(host.train_config, self.num_train[cid])
        flops = update_flops(host, cid, payloads, steps)
        syncs = peak = None
        if host.device.type == "cuda":
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    host.train(round_idx, [cid], payloads)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            syncs = sum("synchronizing" in str(w.message) for w in caught)
            peak = torch.cuda.max_memory_allocated() - held
        host.states[cid] = state
        return {"architecture": name, "client": cid, "flops": flops, "host_syncs": syncs, "peak_gpu_bytes": peak,
                "local_steps": steps, "num_train": self.num_train[cid]}

    def profiled_update(self, round_idx: int, out_dir: Path, trace: bool = False) -> dict[str, Any]:
        """One steady local update of :meth:`first_client` in round ``round_idx``, after a warm-up update from the
        same state, under torch.profiler (benchmarks/update_profile.py; files into ``out_dir``); the client's state
        is restored after both."""
        name, cid = self.first_client(round_idx)
        host = self.hosts[name]
        payloads, state = self.driver.payloads([cid], False), host.states[cid]
        try:
            host.train(round_idx, [cid], payloads)
            host.states[cid] = state
            profiled = profile_local_update(lambda: host.train(round_idx, [cid], payloads), out_dir, trace,
                                            host.device)
        finally:
            host.states[cid] = state
        print(f"[bench] profiled a local update of client {cid}: {profiled['wall_s']:.2f} s; {out_dir}/profile.md",
              flush=True)
        return {"architecture": name, "client": cid, "round": round_idx + 1, "dir": str(out_dir),
                **{k: profiled[k] for k in ("wall_s", "host") if k in profiled},
                **({"cuda_busy_s": profiled["cuda"]["busy_s"], "gpu_idle_fraction": profiled["cuda"]["idle_fraction"]}
                   if "cuda" in profiled else {})}


def update_flops(host: ClientActor, client_id: int, payloads: Any, steps: int) -> float:
    """The FLOPs of ``client_id``'s local update of ``steps`` steps, counted over updates of 1 and 2 steps and
    extrapolated: an update's FLOPs are a fixed part (teachers or stages run once an update) plus the same amount
    each step. torch's counter dispatches every op in Python, which takes minutes over a paper-size update."""
    if steps <= 2:
        return host.local_update_flops(client_id, payloads)
    train = host.train_config
    counted = []
    for counted_steps in (1, 2):
        host.train_config = train.model_copy(update={"local_steps": counted_steps, "local_epochs": None})
        try:
            counted.append(host.local_update_flops(client_id, payloads))
        finally:
            host.train_config = train
    return counted[0] + (steps - 1) * (counted[1] - counted[0])


def _ideal_built(config: RunConfig) -> tuple[MethodLoop, float, dict[str, Any]]:
    ideal, built_s = _timed(lambda: MethodLoop(config))
    profile = ideal.update_profile(0)
    print(f"[bench] {config.methods[0].label}: the ideal's actors built in {built_s:.1f} s; a local update "
          f"{profile['flops'] / 1e12:.3g} TFLOP, {profile['host_syncs']} host syncs", flush=True)
    return ideal, built_s, profile


@dataclass(frozen=True)
class ProfileRequest:
    """``--profile``: profile one steady local update of the method after its rounds into ``out_dir``; ``trace``:
    also chrome's trace (large)."""

    out_dir: Path
    trace: bool = False


def _ideal_run(config: RunConfig, evaluate: bool = True, profile_request: ProfileRequest | None = None,
               ) -> tuple[dict[str, Any], list[weakref.ref]]:
    """The ideal's whole run on its own (``ideal_apart``, ``ideal_only``): its rounds, then (``evaluate``) one
    evaluation of every client and (``profile_request``) a profiled update; with weak references to its models,
    which die when it returns."""
    ideal, built_s, profile = _ideal_built(config)
    rounds = []
    for round_idx in range(config.federation.rounds):
        rounds.append(ideal.run_round(round_idx))
        print(f"[bench] the ideal's round {round_idx + 1}: {rounds[-1]['round_s']:.2f} s", flush=True)
    evaluation_s = ideal.evaluation_s(config.federation.rounds) if evaluate else None
    profiled = (None if profile_request is None else
                ideal.profiled_update(config.federation.rounds - 1, profile_request.out_dir, profile_request.trace))
    return {"built_s": built_s, "profile": profile, "rounds": rounds, "evaluation_s": evaluation_s,
            "profiled_update": profiled}, ideal.models()


def _released(models: list[weakref.ref]) -> dict[str, Any]:
    """Whether the ideal's models are gone, once collected, and the GPU memory this process still holds."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    released = all(model() is None for model in models)
    if not released:
        print("[bench] warning: the ideal's models are still referenced after its run; rayfed's actors share the "
              "GPU with them", flush=True)
    return {"ideal_released": released, "gpu_mib_held_after_ideal":
            torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None}


def rayfed_run(config: RunConfig, run_dir: Path, each_round: Callable[[int, float], None] | None = None,
               ) -> dict[str, Any]:
    """rayfed's run of ``config`` (one method) into ``run_dir``: each round's wall seconds, clients, timeline
    (:func:`round_timeline`) and busiest actor's local updates; the actors' resource usage; the Ray cluster's GPUs
    and those its actors held; the end of the run (its final evaluation and post-FL stage, results written); the
    method's mean metrics. ``each_round(rounds_done, wall_s)`` runs after each round, before the next starts."""
    rounds = config.federation.rounds
    seen: dict[str, Any] = {"usage": [], "round_times": [], "server_times": [], "round_ends": []}
    last_round_end = 0.0

    def after_round(sim: Simulation, label: str, rounds_done: int) -> None:
        nonlocal last_round_end
        seen["round_ends"].append(time.time())
        if rounds_done == rounds:
            executor = sim.executor
            seen["usage"] = executor.get([actor.resource_usage.remote() for actor in sim.actors])
            seen["round_times"] = executor.get([actor.get_round_times.remote() for actor in sim.actors])
            seen["server_times"] = executor.get(sim.driver.get_call_times.remote())
            seen["actors"] = len(sim.actors)
            if ray.is_initialized():
                seen["cluster_gpus"] = ray.cluster_resources().get("GPU", 0.0)
                seen["actor_gpus"] = seen["cluster_gpus"] - ray.available_resources().get("GPU", 0.0)
        if each_round is not None:
            wall = next(event["wall_s"] for event in reversed(sim.log.events) if event["event"] == "round")
            each_round(rounds_done, wall)
        last_round_end = time.perf_counter()

    summary = Simulation(config, out_dir=run_dir, callbacks=[after_round], progress=False, check_model=False).run()
    end_of_run = time.perf_counter() - last_round_end
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [e["wall_s"] for e in events if e["event"] == "round"]
    ends = seen["round_ends"]
    label = config.methods[0].label
    return {
        "round_s": walls, "participants": [e["participants"] for e in events if e["event"] == "round"],
        "timelines": [round_timeline(end - wall, end, previous, seen["round_times"], seen["server_times"], index)
                      for index, (wall, end, previous) in enumerate(zip(walls, ends, [0.0, *ends]))],
        "busiest_update_s": [max((t["update_s"] for times in seen["round_times"] for t in times if t["round"] == r),
                                 default=0.0) for r in range(rounds)],
        "usage": seen["usage"], "actors": seen.get("actors"),
        "cluster_gpus": seen.get("cluster_gpus"), "actor_gpus": seen.get("actor_gpus"), "end_of_run_s": end_of_run,
        "metrics": {k: v for k, v in summary["methods"][label]["mean"].items() if "/" not in k},
    }


def measure(config: RunConfig, out_dir: Path, ideal_apart: bool = False,
            profile_request: ProfileRequest | None = None) -> dict[str, Any]:
    """rayfed's run of ``config`` (one method), each round paired with the ideal's same round; ``ideal_apart``: the
    ideal's rounds all first, the ideal released before rayfed's run; ``profile_request``: the ideal's profiled
    update after its rounds."""
    rounds = config.federation.rounds
    apart: dict[str, Any] = {}
    profiled = None
    if ideal_apart:
        alone, models = _ideal_run(config, profile_request=profile_request)
        apart = _released(models)
        profiled = alone["profiled_update"]
        ideal = None
        built_s, profile, ideal_rounds, ideal_evaluation = (alone["built_s"], alone["profile"], alone["rounds"],
                                                            alone["evaluation_s"])
    else:
        ideal, built_s, profile = _ideal_built(config)
        ideal_rounds = []

    def each_round(rounds_done: int, wall: float) -> None:
        if ideal is None:
            print(f"[bench] round {rounds_done}: rayfed {wall:.2f} s", flush=True)
        else:
            ideal_rounds.append(ideal.run_round(rounds_done - 1))
            print(f"[bench] round {rounds_done}: rayfed {wall:.2f} s, the ideal "
                  f"{ideal_rounds[-1]['round_s']:.2f} s", flush=True)

    ran = rayfed_run(config, out_dir / "run", each_round)
    walls = ran["round_s"]
    label = config.methods[0].label
    if ideal is not None:
        ideal_evaluation = ideal.evaluation_s(rounds)
        if profile_request is not None:
            profiled = ideal.profiled_update(rounds - 1, profile_request.out_dir, profile_request.trace)
    timed = slice(1, None) if rounds > 1 else slice(None)  # the first round warms up both
    means = _ideal_means(ideal_rounds)
    mean_round, ideal_round, ideal_update = (statistics.mean(walls[timed]), means["mean_ideal_round_s"],
                                             means["mean_ideal_update_s"])
    clients_per_round = means["clients_per_round"]
    flops_per_round = profile["flops"] * clients_per_round
    usage = ran["usage"]
    return {
        "label": label, "rounds": rounds, "round_s": walls,
        "interleaved": not ideal_apart, **apart,
        "participants": ran["participants"],
        "ideal_rounds": ideal_rounds, "mean_round_s": mean_round, **means, "overhead_ratio": mean_round / ideal_round,
        "mean_update_s": statistics.mean(ran["busiest_update_s"][timed]), "timelines": ran["timelines"],
        "end_of_run_s": ran["end_of_run_s"], "ideal_evaluation_s": ideal_evaluation,
        "update_profile": profile, "ideal_build_s": built_s, "tflops_per_s": flops_per_round / ideal_update / 1e12,
        "rayfed_tflops_per_s": flops_per_round / mean_round / 1e12,
        "peak_gpu_mib_per_actor": max((u["gpu_peak_bytes"] for u in usage), default=0) / 2**20,
        "peak_host_mib_per_actor": max((u["rss_bytes"] for u in usage), default=0) / 2**20,
        "metrics": ran["metrics"], "profiled_update": profiled,
    }


def measure_ideal(config: RunConfig, profile_request: ProfileRequest | None = None) -> dict[str, Any]:
    """The ideal's rounds of ``config`` alone (``ideal_only``): no rayfed run and no evaluation, for the TFLOP/s of
    the method's local updates at the cost of its rounds only (and ``profile_request``'s profiled update)."""
    alone, models = _ideal_run(config, evaluate=False, profile_request=profile_request)
    rounds, profile = alone["rounds"], alone["profile"]
    means = _ideal_means(rounds)
    return {
        "label": config.methods[0].label, "rounds": len(rounds), "ideal_only": True, **_released(models),
        "ideal_rounds": rounds, **means, "update_profile": profile, "ideal_build_s": alone["built_s"],
        "tflops_per_s": profile["flops"] * means["clients_per_round"] / means["mean_ideal_update_s"] / 1e12,
        "peak_gpu_mib_per_actor": None, "profiled_update": alone["profiled_update"],
    }


def _ideal_means(ideal_rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The ideal's mean seconds a round and clients a round, over its rounds after the first (a warm-up) when it
    ran more than one: the timed rounds (a method may train other clients in its first, pFedMMA all of them); and
    what its first round spent setting up (:func:`first_round_setup`)."""
    timed = ideal_rounds[1:] if len(ideal_rounds) > 1 else ideal_rounds
    return {"clients_per_round": statistics.mean(len(r["clients"]) for r in timed),
            **{f"mean_ideal_{part}_s": statistics.mean(r[f"{part}_s"] for r in timed)
               for part in ("round", "update", "server", "public_pass")},
            "first_round_setup": first_round_setup(ideal_rounds)}


def round_timeline(start: float, end: float, after: float, actor_times: list[list[dict[str, float]]],
                   server_times: list[dict[str, float]], round_idx: int) -> dict[str, Any]:
    """Where rayfed's round ``round_idx`` (wall-clock ``start`` to ``end``; its server calls are those between
    ``after``, the previous round's end, and ``end``) went, in seconds from its start: the
    DriverActor's payload calls (their sum, when the last ended), when the ClientActors' train_round calls started
    (their payloads arrived), ended their updates and returned, when the aggregation's call started (every upload
    arrived), the seconds it fetched the upload slots sent on ahead, stored a mixture's rows and ran the method's
    aggregate, and when it ended.
    (``ClientActor.get_round_times``, ``DriverActor.get_call_times``.)"""
    calls = [call for times in actor_times for call in times if call["round"] == round_idx]
    payloads = [call for call in server_times if call["call"] == "payloads" and after < call["start"] <= end]
    [aggregation] = [call for call in server_times if call["call"] == "aggregate" and after < call["start"] <= end]

    def since(moment: float) -> float:
        return round(moment - start, 4)

    return {
        "round": round_idx + 1, "wall_s": round(end - start, 4),
        "payloads_s": round(sum(call["end"] - call["start"] for call in payloads), 4),
        "payloads_done_at": since(max(call["end"] for call in payloads)),
        "actors_started_at": sorted(since(call["start"]) for call in calls),
        "actors_updated_at": sorted(since(call["updated"]) for call in calls),
        "actors_ended_at": sorted(since(call["end"]) for call in calls),
        "busiest_update_s": max(call["update_s"] for call in calls),
        "aggregation_at": since(aggregation["start"]),
        "fetch_s": round(aggregation.get("fetch_s", 0.0), 4),
        "store_s": round(aggregation.get("store_s", 0.0), 4),
        "aggregate_s": round(aggregation.get("aggregate_s", 0.0), 4),
        "aggregation_done_at": since(aggregation["end"]),
    }


def reference_config(config: RunConfig) -> RunConfig:
    """A plain LoRA FedAvg run on ``config``'s clients, backbone and batch (every architecture's own backbone), in the
    model the workload trains: the engine's with LoRA, or the workload's ``model.client`` as configured (TAP's MoME
    puts LoRA on the backbone and its experts; the engine's FLAVA has no text decoder for TAP's generation tasks)."""
    if config.model.client is not None:
        return load_config(config, ["methods=[fedavg]", WITHOUT_MATCHING])
    lora = config.model.lora.model_dump() if config.model.lora is not None else {"rank": 16, "alpha": 32}
    return load_config(config, ["methods=[fedavg]", WITHOUT_MATCHING, "model.module=lora",
                                f"model.lora={json.dumps(lora)}"])


def resolved_workload(workload: str | MethodWorkload) -> tuple[str, MethodWorkload]:
    """A workload given by name (one of :data:`METHOD_WORKLOADS`) or as itself, with its name."""
    if isinstance(workload, MethodWorkload):
        return workload.label, workload
    if workload not in METHOD_WORKLOADS:
        raise choice_error("--workload", workload, METHOD_WORKLOADS)
    return workload, METHOD_WORKLOADS[workload]


def results_header(name: str, workload: MethodWorkload, smoke: bool, overrides: tuple[str, ...],
                   **options: Any) -> dict[str, Any]:
    """bench.json's first keys: what ran (the workload, its overrides and the bench's ``options``) and where."""
    return {
        "workload": {"name": name, **asdict(workload), "smoke": smoke, "overrides": list(overrides), **options},
        "machine": {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    "num_gpus": torch.cuda.device_count(), "torch": torch.__version__, **this_gpu_peak()},
    }


def run_method_bench(workload: str | MethodWorkload, out_dir: Path, rounds: int | None = None, smoke: bool = False,
                     overrides: tuple[str, ...] = (), reference: bool = True, ideal_apart: bool = False,
                     ideal_only: bool = False, profile: bool = False, profile_trace: bool = False) -> dict[str, Any]:
    """The bench of ``workload`` (or the one :data:`METHOD_WORKLOADS` names), with the plain LoRA FedAvg reference's
    step rate beside it when ``reference``; writes ``bench.json`` and ``bench.md`` into ``out_dir``. ``ideal_apart``:
    see :func:`measure`; ``ideal_only``: the ideal's rounds alone (:func:`measure_ideal`), for the TFLOP/s ratio;
    ``profile``: a steady local update of the method profiled into ``out_dir/profile`` (``profile_trace``: with
    chrome's trace). Each run's rates come with their MFU, and the method's rounds with the paper schedule's time
    to result (benchmarks/time_to_result.py)."""
    if ideal_only and ideal_apart:
        raise ConfigError("--ideal-only runs no rayfed run to keep the ideal apart from; give one of --ideal-only "
                          "and --ideal-apart.")
    name, workload = resolved_workload(workload)
    config = workload_config(workload, rounds or workload.rounds, smoke, overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = results_header(name, workload, smoke, overrides, ideal_apart=ideal_apart, ideal_only=ideal_only,
                             profile=profile)
    peak = results["machine"]["bf16_peak_tflops"]
    request = ProfileRequest(out_dir / "profile", profile_trace) if profile else None
    with tempfile.TemporaryDirectory(prefix=f"rayfed-bench-{name}-") as scratch:
        def run(run_config: RunConfig, scratch_dir: Path, profiled: ProfileRequest | None) -> dict[str, Any]:
            measured = (measure_ideal(run_config, profiled) if ideal_only
                        else measure(run_config, scratch_dir, ideal_apart, profiled))
            return {**measured, **{f"{rate}mfu": mfu(measured.get(f"{rate}tflops_per_s"), peak)
                                   for rate in ("", "rayfed_") if f"{rate}tflops_per_s" in measured}}

        results["method"] = run(config, Path(scratch), request)
        results["time_to_result"] = estimate_time_to_result(workload, smoke, overrides, results["method"])
        atomic_write_json(out_dir / "bench.json", results)
        if reference:
            results["reference"] = run(reference_config(config), Path(scratch) / "reference", None)
            results["tflops_ratio"] = results["method"]["tflops_per_s"] / results["reference"]["tflops_per_s"]
    atomic_write_json(out_dir / "bench.json", results)
    atomic_write_text(out_dir / "bench.md", markdown(results))
    return results


def estimate_time_to_result(workload: MethodWorkload, smoke: bool, overrides: tuple[str, ...],
                            run: dict[str, Any]) -> dict[str, Any]:
    """The paper schedule's time on one GPU and its sweep's trials per GPU-hour (:func:`time_to_result`) from the
    method's measured ``run``: rayfed's rounds and busiest actor's updates where rayfed ran, else the ideal's. The
    paper's steps an update are the config's ``local_steps``; with ``local_epochs`` the measured client's steps on
    the paper's data, unknown when ``overrides`` change the data."""
    paper = load_config(REPO / (workload.smoke_config if smoke else workload.config))
    schedule = paper_schedule(paper)
    profile = run["update_profile"]
    paper_steps = schedule.local_steps
    if paper_steps is None and not any(o.startswith("data.") for o in overrides):
        paper_steps = local_steps(paper.train, profile["num_train"])
    rayfed_ran = "mean_round_s" in run
    sweep = None
    if workload.sweep is not None:
        sweep = {"config": workload.sweep, **sweep_size(yaml.safe_load((REPO / workload.sweep).read_text())["tune"])}
    return time_to_result(
        schedule, run["mean_round_s" if rayfed_ran else "mean_ideal_round_s"],
        run["mean_update_s" if rayfed_ran else "mean_ideal_update_s"], profile["local_steps"], paper_steps,
        run["clients_per_round"], run.get("ideal_evaluation_s"), sweep)


ROW_KEYS = ("mean_round_s", "mean_ideal_round_s", "overhead_ratio", "mean_update_s", "mean_ideal_update_s",
            "mean_ideal_server_s", "mean_ideal_public_pass_s", "end_of_run_s", "ideal_evaluation_s", "tflops_per_s")


def markdown(results: dict[str, Any]) -> str:
    rows = []
    for role in ("method", "reference"):
        if role in results:
            run = results[role]
            profile = run["update_profile"]
            syncs = profile["host_syncs"]
            rows.append([run["label"] if role == "method" else "LoRA FedAvg",
                         *("-" if run.get(k) is None else f"{run[k]:.3g}" for k in ROW_KEYS),
                         mfu_cell(run.get("mfu")),
                         "-" if syncs is None else str(syncs),
                         "-" if profile["peak_gpu_bytes"] is None else f"{profile['peak_gpu_bytes'] / 2**20:.0f}",
                         "-" if run["peak_gpu_mib_per_actor"] is None else f"{run['peak_gpu_mib_per_actor']:.0f}"])
    header = ["method", "s/round", "ideal s/round", "overhead", "updates s (busiest actor)", "ideal updates s",
              "ideal server hooks s", "ideal public passes s", "end of run s", "ideal evaluation s", "TFLOP/s",
              "MFU", "host syncs/update", "peak GPU MiB/client", "peak GPU MiB/actor"]
    workload = results["workload"]
    ratio = results.get("tflops_ratio")
    return (header_markdown(results)
            + ("The rounds were not interleaved: the ideal ran all its rounds first and was released, then rayfed's "
               "run.\n\n" if workload.get("ideal_apart") else "")
            + ("Only the ideal ran (--ideal-only): no rayfed run, no evaluation.\n\n" if workload.get("ideal_only")
               else "") + format_table(rows, header)
            + mfu_footnote(results["machine"])
            + ("" if ratio is None else f"\nTFLOP/s of the method's local updates / a plain LoRA FedAvg step's: "
               f"{ratio:.2f}\n")
            + ("" if "time_to_result" not in results else time_to_result_markdown(results["time_to_result"]))
            + first_round_setup_markdown(results["method"].get("first_round_setup"))
            + profiled_markdown(results["method"].get("profiled_update"))
            + timeline_markdown(results["method"]))


def profiled_markdown(profiled: dict[str, Any] | None) -> str:
    """bench.md's line on ``--profile``'s profiled update (its breakdown is in its own profile.md)."""
    if profiled is None:
        return ""
    idle = profiled.get("gpu_idle_fraction")
    return (f"\nProfiled: a local update of client {profiled['client']} (round {profiled['round']}) in "
            f"{profiled['wall_s']:.2f} s" + ("" if idle is None else f", the GPU idle {100 * idle:.1f}% of it")
            + f"; breakdown in {profiled['dir']}/profile.md.\n")


def header_markdown(results: dict[str, Any]) -> str:
    """bench.md's first lines: the workload with its overrides, and the machine (:func:`results_header`)."""
    workload, machine = results["workload"], results["machine"]
    return (f"Workload `{workload['name']}`: {workload['smoke_config' if workload['smoke'] else 'config']}"
            f"{' ' + ' '.join(workload['overrides']) if workload['overrides'] else ''}\n\n"
            f"Machine: {machine_name(machine)}, torch {machine['torch']}\n\n")


def machine_name(machine: dict[str, Any]) -> str:
    gpus = machine.get("num_gpus", 1)
    return "CPU only" if not machine["gpu"] else f"{gpus} x {machine['gpu']}" if gpus > 1 else machine["gpu"]


TIMELINE_HEADER = ["round", "s", "payloads s (done at)", "actors start at", "updates end at", "actors end at",
                   "aggregation at", "fetch / store / aggregate s", "aggregation done at"]


def timeline_markdown(run: dict[str, Any]) -> str:
    """rayfed's rounds of ``run`` as :func:`round_timeline` places them, a row each."""
    def spread(moments: list[float]) -> str:
        return f"{moments[0]:.2f}" if moments[0] == moments[-1] else f"{moments[0]:.2f}-{moments[-1]:.2f}"

    rows = [[str(t["round"]), f"{t['wall_s']:.2f}", f"{t['payloads_s']:.2f} ({t['payloads_done_at']:.2f})",
             spread(t["actors_started_at"]), spread(t["actors_updated_at"]), spread(t["actors_ended_at"]),
             f"{t['aggregation_at']:.2f}", f"{t['fetch_s']:.2f} / {t['store_s']:.2f} / {t['aggregate_s']:.2f}",
             f"{t['aggregation_done_at']:.2f}"] for t in run.get("timelines", [])]
    if not rows:
        return ""
    return ("\nrayfed's rounds of the method, in seconds from each round's start (the actors' train_round calls "
            "start once their payloads arrive; the aggregation once every upload has):\n\n"
            + format_table(rows, TIMELINE_HEADER))
