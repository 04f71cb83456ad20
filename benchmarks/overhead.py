"""`rayfed bench`: rayfed's wall time per round against the ideal on the same device.

The ideal is one process running the same client training steps back to back with the same
model (no Ray, no actors, no aggregation): what a hand-written single-GPU loop would cost.
Each of its rounds runs right after rayfed's same round, in the bench process while rayfed's
actors wait, so both see the same host: on the lent GPU hosts the same loop drifts by tens of
percent within minutes, and an ideal timed before or after a whole run is no fair reference.
overhead ratio = rayfed's round wall time / the ideal's, over the same rounds (the first
round is a warm-up for both and is left out).

Next to s/round, both report achieved TFLOP/s: the FLOPs of one client training step, counted once
with torch's FlopCounterMode (forward + backward: matrix products and attention), times the round's
steps, over the round's time; text workloads also report tokens/s (the counted step's batch's
attention mask times the round's steps, over its time).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from rayfed.actors.client import ClientActor
from rayfed.benchmarks.mfu import mfu, mfu_cell, mfu_footnote, this_gpu_peak
from rayfed.config import RunConfig, load_config
from rayfed.errors import ConfigError, choice_error
from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.method import tensor_bytes
from rayfed.models import LLM_LORA_TARGETS
from rayfed.results.report import format_table
from rayfed.simulation import Simulation, init_local_ray
from rayfed.tasks import sample_round
from rayfed.training import ClientContext
from rayfed.types import TensorDict

TASKS = ("image_classification", "text_generation")


@dataclass(frozen=True)
class Workload:
    """One fixed FL workload; the defaults are the CPU smoke size. ``task`` picks the clients' data: synthetic
    images of ``image_size`` pixels for a classifier head, or synthetic text (``synthetic-text``, a copy task)
    for a causal LM, every sequence exactly ``seq_len`` tokens, the last ``target_words`` + 1 of them the target."""

    backbone: str = "tiny:vit"
    task: str = "image_classification"
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    image_size: int = 16
    seq_len: int = 64
    target_words: int = 16
    num_clients: int = 20
    clients_per_round: int = 4
    local_steps: int = 5
    batch_size: int = 16
    samples_per_client: int = 32
    rounds: int = 3
    method: str = "fedavg"
    cuda_graphs: bool = False  # train.cuda_graphs: each actor replays one captured training step
    compile: bool = False  # train.compile: the steps run torch.compile's kernels
    batch_clients: int = 1  # train.batch_clients: rayfed's actors train this many clients per step (the ideal: one)
    client_memory: bool = True  # also measure the memory a hosted client adds (builds two more models)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise choice_error("Workload.task", self.task, TASKS)
        if self.task == "text_generation" and not 1 <= self.target_words <= (self.seq_len - 2) // 2:
            raise ConfigError(f"Workload.target_words = {self.target_words} is invalid: the target copies the "
                              f"prompt's first words, so it must be in 1..{(self.seq_len - 2) // 2} for seq_len = "
                              f"{self.seq_len}.")

    def config(
        self, clients_per_actor: int, gpus_per_actor: float, seed: int = 0, client_state: str = "auto",
    ) -> RunConfig:
        return load_config({
            "name": "bench",
            "seed": seed,
            "data": self._data(),
            "model": {"backbone": self.backbone, "lora": {"rank": self.lora_rank, "alpha": self.lora_rank,
                                                          "targets": list(self.lora_targets)}},
            "federation": {"rounds": self.rounds, "clients_per_round": self.clients_per_round,
                           "eval_every": self.rounds + 1},
            "train": {"local_steps": self.local_steps, "batch_size": self.batch_size, "optimizer": "adam", "lr": 1e-3,
                      "cuda_graphs": self.cuda_graphs, "compile": self.compile, "batch_clients": self.batch_clients},
            "methods": [self.method],
            "placement": {"clients_per_actor": clients_per_actor, "cpus_per_actor": 1, "gpus_per_actor": gpus_per_actor,
                          "client_state": client_state},
        })

    def _data(self) -> dict[str, Any]:
        samples = self.num_clients * self.samples_per_client
        clients = {"num_clients": self.num_clients, "partition": {"name": "iid"}}
        if self.task == "image_classification":
            return {"source": "synthetic", "synthetic": {"num_samples": samples, "num_classes": 10,
                                                         "image_size": self.image_size, "channels": 3}, **clients}
        # The word tokenizer of llama: backbones makes one token of a word, plus <bos> and the target's <eos>.
        prompt_words = self.seq_len - self.target_words - 2
        return {"source": "synthetic-text", "kind": "text_generation", "max_text_length": self.seq_len,
                "options": {"num_samples": samples, "prompt_words": prompt_words, "target_words": self.target_words},
                **clients}


# 96 samples a client keep 72 for training (data.test_fraction 0.25), so every step trains a whole batch of 64;
# until 2026-11-28 it had 64 samples, and its steps trained the 48 of them.
GPU_WORKLOAD = Workload(
    backbone="open_clip:ViT-B-16", lora_rank=16, lora_targets=("c_fc", "c_proj"), image_size=32,
    num_clients=100, clients_per_round=16, local_steps=10, batch_size=64, samples_per_client=96, rounds=6,
    cuda_graphs=True,
)

# Llama-3.2-1B's shape, randomly initialised (bf16 weights on a GPU), + LoRA r16 on all seven linear layers of
# every block (rayfed's default for LLMs, as QLoRA-style recipes train them), FlowerTune-LLM's sizes: 20 clients, a
# few per round, 10 local steps on sequences of 512 tokens. Each probe of client memory would build two more
# 1.2 B-parameter models. CUDA graphs: an eager step waits on the host's kernel launches (on an H100 the GPU was
# busy 59-78% of a round), so its rounds vary with the host by 25% and more.
LLM_WORKLOAD = Workload(
    backbone="llama:1B", task="text_generation", lora_rank=16, lora_targets=LLM_LORA_TARGETS, seq_len=512,
    target_words=32, num_clients=20, clients_per_round=4, local_steps=10, batch_size=8, samples_per_client=16,
    rounds=5, client_memory=False, cuda_graphs=True,
)
LLM_CPU_WORKLOAD = dataclasses.replace(
    LLM_WORKLOAD, backbone="llama:tiny", seq_len=64, target_words=8, num_clients=4, clients_per_round=2,
    local_steps=2, batch_size=4, samples_per_client=8, rounds=2,
)
WORKLOADS: dict[str, Workload] = {
    "cpu": Workload(), "gpu": GPU_WORKLOAD, "llm": LLM_WORKLOAD, "llm-cpu": LLM_CPU_WORKLOAD,
}


def workload_named(name: str) -> Workload:
    """The workload ``--workload name`` selects (a key of :data:`WORKLOADS`)."""
    if name not in WORKLOADS:
        raise choice_error("--workload", name, WORKLOADS)
    return WORKLOADS[name]


@dataclass(frozen=True)
class StepWork:
    """What one client training step computes: FLOPs (forward + backward) and its batch's tokens (None: no text)."""

    flops: int
    tokens: int | None

    def rates(self, steps: int, seconds: float) -> dict[str, float | None]:
        """Tokens/s and achieved TFLOP/s of ``steps`` such steps in ``seconds``."""
        return {"tokens_per_s": None if self.tokens is None else self.tokens * steps / seconds,
                "tflops_per_s": self.flops * steps / seconds / 1e12}


def _with_query_heads(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> tuple[Sequence[int], ...]:
    """Grouped-query attention's K / V shapes with the query's heads: the products it runs (torch's formulas
    assume equal heads and reject fewer K / V heads)."""
    heads = query[1]
    return query, (key[0], heads, *key[2:]), (value[0], heads, *value[2:])


def _sdpa_flops(query: Sequence[int], key: Sequence[int], value: Sequence[int], *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(*_with_query_heads(query, key, value))


def _sdpa_backward_flops(grad_out: Sequence[int], query: Sequence[int], key: Sequence[int], value: Sequence[int],
                         *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, *_with_query_heads(query, key, value))


aten = torch.ops.aten
GQA_FLOPS = {  # FlopCounterMode's custom_mapping: the GPU attention kernels (the CPU one counts nothing)
    **{op: _sdpa_flops for op in (aten._scaled_dot_product_efficient_attention,
                                  aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_cudnn_attention)},
    **{op: _sdpa_backward_flops for op in (aten._scaled_dot_product_efficient_attention_backward,
                                           aten._scaled_dot_product_flash_attention_backward,
                                           aten._scaled_dot_product_cudnn_attention_backward)},
}


def count_step_work(context: ClientContext, params: TensorDict) -> StepWork:
    """One training step of ``context`` from ``params``, its FLOPs counted by torch's FlopCounterMode (matrix
    products and attention; elementwise work and the optimizer's update count nothing) and its tokens read from
    the attention mask of the batch the model is called on."""
    batches: list[Any] = []
    hook = context.model.register_forward_pre_hook(lambda module, args: batches.append(args[0]))
    try:
        with FlopCounterMode(display=False, custom_mapping=GQA_FLOPS) as counter:
            context.train(params, steps=1)
    finally:
        hook.remove()
    mask = batches[0].get("attention_mask") if isinstance(batches[0], dict) else None
    return StepWork(counter.get_total_flops(), None if mask is None else int(mask.sum()))


class IdealLoop:
    """The ideal: the same clients' training steps, round by round, back to back in this process."""

    def __init__(self, workload: Workload):
        self.config = workload.config(clients_per_actor=workload.num_clients, gpus_per_actor=0)
        self.host = ClientActor(self.config.to_dict(), list(range(workload.num_clients)))
        # On the training device, as a hand-written loop keeps them: a copy from the host before each client
        # would make the host wait for the previous client's steps.
        self.shared = {name: value.to(self.host.device) for name, value in self.host.start_method(0).items()}

    def step_work(self) -> StepWork:
        """The work of one client step (client 0's first), run eagerly: a replayed CUDA graph and compiled kernels
        compute the same products."""
        context = self.host._context(0, 0)
        context.train_config = context.train_config.model_copy(update={"cuda_graphs": False, "compile": False})
        return count_step_work(context, self.shared)

    def run_round(self, round_idx: int) -> float:
        """Seconds for round ``round_idx``'s sampled clients, each trained from the same shared parameters."""
        sampled = sample_round(self.config, round_idx)  # the clients rayfed's round trains
        synchronize(self.host.device)
        started = time.perf_counter()
        for cid in sampled:
            self.host._context(cid, round_idx).train(self.shared)
        synchronize(self.host.device)
        return time.perf_counter() - started


def measure_rayfed(workload: Workload, actors_per_gpu: int, num_gpus: int, ideal: IdealLoop) -> dict[str, Any]:
    """One rayfed run; after each of its rounds (outside the round's timing) ``ideal`` runs the same round."""
    devices = max(num_gpus, 1)
    num_actors = actors_per_gpu * devices
    config = workload.config(
        clients_per_actor=math.ceil(workload.num_clients / num_actors),
        gpus_per_actor=1 / actors_per_gpu if num_gpus else 0,
    )
    usage: list[dict] = []
    round_ends: list[float] = []
    round_times: list[list[dict[str, float]]] = []
    ideal_round_s: list[float] = []

    def after_round(sim: Simulation, label: str, rounds_done: int) -> None:
        round_ends.append(time.time())
        ideal_round_s.append(ideal.run_round(rounds_done - 1))
        if rounds_done == workload.rounds:
            usage.extend(ray.get([actor.resource_usage.remote() for actor in sim.actors]))
            round_times.extend(ray.get([actor.get_round_times.remote() for actor in sim.actors]))

    out_dir = Path(tempfile.mkdtemp(prefix=f"rayfed-bench-{actors_per_gpu}x{num_gpus}-")) / "run"
    started = time.perf_counter()
    # No model check in this process: the ideal loop has built and trained the same model here already (for
    # the LLM the check would build another 1.2 B-parameter model and run it on one CPU thread).
    summary = Simulation(config, out_dir=out_dir, callbacks=[after_round], progress=False, check_model=False).run()
    total = time.perf_counter() - started
    events = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [e["wall_s"] for e in events if e["event"] == "round"]
    breakdown = round_breakdown(walls, round_ends, round_times)[1:]
    busy = [e["actor_busy_s"] for e in events if e["event"] == "round"][1:]
    return {
        "actors_per_gpu": actors_per_gpu, "num_gpus": num_gpus, "num_actors": len(usage),
        "round_s": walls[1:], "ideal_round_s": ideal_round_s[1:], "total_s": total, "usage": usage,
        "breakdown": breakdown,
        **{f"mean_{key}": _mean([b[key] for b in breakdown]) for key in BREAKDOWN_KEYS},
        # the busiest actor's local updates against an even share of the round's (balanced rounds)
        "mean_busiest_actor_s": _mean([max(b) for b in busy]),
        "mean_even_share_s": _mean([sum(b) / num_actors for b in busy]),
        "local_metrics": summary["methods"][workload.method]["mean"],
    }


BREAKDOWN_KEYS = ("update_s", "actor_rest_s", "before_actors_s", "after_actors_s")


def round_breakdown(
    walls: list[float], round_ends: list[float], actor_times: list[list[dict[str, float]]],
) -> list[dict[str, float]]:
    """Where each round's wall time went: the clients' local updates and the partial sum of their uploads
    (the longest of any actor); the rest of the actors' train_round calls beyond that (guests' states, the
    partial sum's copy to the host);
    before the first actor starts (payloads, Ray calls); after the last one ends (its uploads to the
    DriverActor, aggregation, logging). ``round_ends`` are wall-clock times taken by a round callback."""
    rounds = []
    for index, (wall, end) in enumerate(zip(walls, round_ends)):
        calls = [call for times in actor_times for call in times if call["round"] == index]
        first, last = min(c["start"] for c in calls), max(c["end"] for c in calls)
        update = max(c["update_s"] for c in calls)
        rounds.append({"round": index, "wall_s": wall, "update_s": update, "actor_rest_s": last - first - update,
                       "before_actors_s": wall - (last - first) - (end - last), "after_actors_s": end - last})
    return rounds


def memory_per_client(workload: Workload, client_state: str, num_clients: int = 16) -> dict[str, float]:
    """Memory each hosted client's own state adds (Ditto: a personal LoRA + head), next to its tensors' size.

    ``client_state="host"`` measures resident host memory, ``"device"`` allocated GPU memory.
    """
    sized = dataclasses.replace(workload, num_clients=num_clients, clients_per_round=4, method="ditto")
    config = sized.config(clients_per_actor=num_clients, gpus_per_actor=0, client_state=client_state)
    host = ClientActor(config.to_dict(), list(range(num_clients)))
    initial = host.start_method(0)
    payloads = {cid: initial for cid in range(num_clients)}
    host.train(0, [0], payloads)  # warm-up: allocator pools, optimizer code paths

    def used() -> int:
        gc.collect()
        if client_state == "device":
            return torch.cuda.memory_allocated(host.device)
        if hasattr(ctypes.CDLL(None), "malloc_trim"):  # glibc keeps freed heap resident; give it back first
            ctypes.CDLL(None).malloc_trim(0)
        return psutil.Process().memory_info().rss

    before = used()
    host.train(1, list(range(1, num_clients)), payloads)  # every client now holds tensors of its own
    added = used() - before
    return {"state_device": str(host.state_device), "bytes_per_client": added / (num_clients - 1),
            "state_bytes_per_client": tensor_bytes(host.states[1])}


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU): timings then cover the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(workload: Workload, actors_per_gpu: tuple[int, ...], out_dir: Path, repeats: int = 1) -> dict[str, Any]:
    """rayfed's runs for each packing (and, on a multi-GPU host, on 1 and all GPUs), each round paired with
    the ideal's same round (:func:`measure_rayfed`). With ``repeats`` > 1 the sweep runs that many times
    over, and ``median_ratios`` gives each one-GPU packing's median overhead ratio.
    """
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: the sweep runs at least once; pass an integer >= 1.")
    num_gpus = torch.cuda.device_count()
    owns_ray = not ray.is_initialized()
    ideal = IdealLoop(workload)
    work = ideal.step_work()
    steps_per_round = workload.clients_per_round * workload.local_steps
    results: dict[str, Any] = {
        "workload": dataclasses.asdict(workload),
        "step_work": {**dataclasses.asdict(work), "steps_per_round": steps_per_round},
        "machine": {"gpu": torch.cuda.get_device_name(0) if num_gpus else None, "num_gpus": num_gpus,
                    **this_gpu_peak(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "ideal_device": str(ideal.host.device),
        "runs": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    # 1, 2, 4, ... GPUs up to all of them: the speed-up of each over one GPU
    gpu_counts = sorted({2**k for k in range(num_gpus.bit_length()) if 2**k <= num_gpus} | {num_gpus}) or [0]
    for gpus in gpu_counts:
        if num_gpus > 1 or not ray.is_initialized():
            # A Ray instance that sees `gpus` GPUs, so fractional actors cannot spread to the others.
            ray.shutdown()
            init_local_ray(object_store_memory=2 * 10**9, num_gpus=gpus)
        for repeat in range(repeats):
            for per_gpu in actors_per_gpu:
                result = measure_rayfed(workload, per_gpu, gpus, ideal)
                mean_round, ideal_round = _mean(result["round_s"]), _mean(result["ideal_round_s"])
                updates = workload.clients_per_round
                result.update(
                    repeat=repeat,
                    mean_round_s=mean_round,
                    mean_ideal_round_s=ideal_round,
                    overhead_ratio=mean_round / ideal_round if gpus <= 1 else None,
                    speedup_vs_ideal=ideal_round / mean_round,
                    client_updates_per_s=updates / mean_round,
                    samples_per_s=updates * workload.local_steps * workload.batch_size / mean_round,
                    **work.rates(steps_per_round, mean_round),
                    **{f"ideal_{key}": rate for key, rate in work.rates(steps_per_round, ideal_round).items()},
                    peak_gpu_mib_per_actor=max(u["gpu_peak_bytes"] for u in result["usage"]) / 2**20,
                    peak_host_mib_per_actor=max(u["rss_bytes"] for u in result["usage"]) / 2**20,
                )
                peak = results["machine"]["bf16_peak_tflops"]
                result.update(mfu=mfu(result["tflops_per_s"], peak), ideal_mfu=mfu(result["ideal_tflops_per_s"], peak))
                results["runs"].append(result)
                atomic_write_json(out_dir / "bench.json", results)  # partial results survive a later failure
                print(f"[bench] {gpus} GPU(s) x {per_gpu} actors: {mean_round:.3f} s/round "
                      f"(ideal, paired rounds: {ideal_round:.3f}; local updates {result['mean_update_s']:.3f})",
                      flush=True)
    if owns_ray or num_gpus > 1:
        ray.shutdown()
    del ideal
    results["median_ratios"] = median_ratios(results["runs"])
    add_speedups(results["runs"])
    results["client_memory"] = []
    if workload.client_memory:
        results["client_memory"].append(memory_per_client(workload, "host"))
        if num_gpus:
            results["client_memory"].append(memory_per_client(workload, "device"))
    atomic_write_json(out_dir / "bench.json", results)
    atomic_write_text(out_dir / "bench.md", markdown(results))
    return results


def add_speedups(runs: list[dict[str, Any]]) -> None:
    """Each run's speed-up over the one-GPU run of the same actors per GPU (its first repeat)."""
    one_gpu = {}
    for run in runs:
        if run["num_gpus"] <= 1:
            one_gpu.setdefault(run["actors_per_gpu"], run["mean_round_s"])
    for run in runs:
        base = one_gpu.get(run["actors_per_gpu"])
        run["speedup_vs_1_gpu"] = None if base is None else base / run["mean_round_s"]


def median_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each packing's median overhead ratio over its runs, keyed "<GPUs>x<actors per GPU>"."""
    ratios: dict[str, list[float]] = {}
    for run in runs:
        if run["overhead_ratio"] is not None:
            ratios.setdefault(f"{run['num_gpus']}x{run['actors_per_gpu']}", []).append(run["overhead_ratio"])
    return {key: statistics.median(values) for key, values in ratios.items()}


def markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    rows = [[
        str(run["num_gpus"]), str(run["actors_per_gpu"]), f"{run['mean_round_s']:.3f}",
        f"{run['mean_ideal_round_s']:.3f}",
        "-" if run["overhead_ratio"] is None else f"{run['overhead_ratio']:.3f}", f"{run['speedup_vs_ideal']:.2f}",
        "-" if run.get("speedup_vs_1_gpu") is None else f"{run['speedup_vs_1_gpu']:.2f}",
        f"{run['client_updates_per_s']:.1f}", f"{run['samples_per_s']:.0f}",
        *(_number(run[key], ".0f") for key in ("tokens_per_s", "ideal_tokens_per_s")),
        *(_number(run[key], ".3g") for key in ("tflops_per_s", "ideal_tflops_per_s")),
        *(mfu_cell(run.get(key)) for key in ("mfu", "ideal_mfu")),
        f"{run['peak_gpu_mib_per_actor']:.0f}", f"{run['peak_host_mib_per_actor']:.0f}",
        *(f"{run['mean_' + key]:.3f}" for key in BREAKDOWN_KEYS),
        f"{run['mean_busiest_actor_s']:.3f} / {run['mean_even_share_s']:.3f}",
    ] for run in results["runs"]]
    header = ["GPUs", "actors/GPU", "s/round", "ideal s/round", "overhead ratio", "x ideal speed", "x 1 GPU",
              "client updates/s", "samples/s", "tokens/s", "ideal tokens/s", "TFLOP/s", "ideal TFLOP/s", "MFU",
              "ideal MFU", "peak GPU MiB/actor",
              "peak host MiB/actor",
              "local updates s", "rest on actor s", "before actors s", "after actors s", "busiest actor / even share s"]
    medians = ", ".join(f"{key}: {ratio:.3f}" for key, ratio in results["median_ratios"].items())
    work = results["step_work"]
    tokens = "" if work["tokens"] is None else f" on {work['tokens']} tokens"
    return (
        f"Workload: `{json.dumps(results['workload'])}`\n\n"
        f"Machine: {machine['gpu'] or 'CPU only'}, {machine['cpus']} CPUs, torch {machine['torch']}\n\n"
        f"Ideal: one process running the same steps back to back on {results['ideal_device']}, each round right "
        "after rayfed's same round (paired rounds); the overhead ratio (one GPU) is rayfed's s/round over the "
        "ideal's, x ideal speed its inverse.\n\n"
        f"Work per round: {work['steps_per_round']} client steps of {work['flops'] / 1e9:.2f} GFLOP{tokens} each "
        "(forward + backward, counted once with torch's FlopCounterMode: matrix products and attention); "
        "TFLOP/s and tokens/s are that over each s/round.\n\n"
        + format_table(rows, header)
        + mfu_footnote(machine)
        + "\nPer round (means over the timed rounds): the clients' local updates on the busiest actor, the rest "
        "of the actors' round calls, and the time before the first actor starts and after the last one ends.\n"
        + (f"\nMedian overhead ratio per GPUs x actors/GPU over the repeats: {medians}.\n" if medians else "")
        + "".join(
            f"\nMemory per hosted client (Ditto personal state kept on {memory['state_device']}): "
            f"{memory['bytes_per_client'] / 2**20:.2f} MiB for {memory['state_bytes_per_client'] / 2**20:.2f} MiB "
            "of tensors.\n"
            for memory in results["client_memory"]
        )
    )
