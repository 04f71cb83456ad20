"""FedMosaic's costs as the paper reports them (Tab. 15, A.8-A.9; docs/fedmosaic.md#costs): memory and compute of a
client's local update relative to SFT's, the one-time alignment, and the overhead of a round with 100 and 1,000
simulated clients on four actors (two per architecture), against SFT (local training alone) and FedAvg.

    python benchmarks/papers/fedmosaic_costs.py --clients 10 100 1000 --out runs/fedmosaic_costs.json

The actors are driven in-process, one after another (``placement.executor: local``; one thread): the times are CPU
seconds of this process (robust to other work on the machine) for the tiny LLaVAs, not the paper's GPUs. Each round:
every client's local update (``local_steps`` steps, W_s's gradient every step for FedMosaic), the server's
aggregation (RELA: the N x N cosines and weights) and every client's payload (its own global adapter).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.architectures import actor_slots
from rayfed.config import load_config
from rayfed.method import tensor_bytes
from rayfed.stages import PreFederationStage, declared

MOSAIC = {"name": "fedmosaic", "relevance_model": "tiny-pretrained:llava", "relevance_history": False,
          "align_lr": 0.001}
METHODS = {"sft": "local", "fedavg": "fedavg", "fedmosaic": MOSAIC}


def setting(clients: int, method: Any, local_steps: int, grad_interval: int, samples_per_client: int = 8) -> dict:
    """``clients`` clients, half on each tiny LLaVA, four actors, one VQA task partitioned iid (``samples_per_client``
    samples each), the public captions for FedMosaic's alignment."""
    half = clients // 2
    entry = {**method, "grad_interval": grad_interval} if isinstance(method, dict) else method
    return {
        "name": f"costs-{clients}", "seed": 0,
        "data": {"source": "task-groups:vqa", "kind": "text_generation", "num_clients": clients,
                 "options": {"group": 0, "num_samples": clients * samples_per_client, "question_types": ["color"],
                             "styles": ["noisy"]},
                 "partition": {"name": "iid"}, "max_text_length": 26,
                 "public": {"source": "multimodal:shapes", "kind": "text_generation", "max_text_length": 32,
                            "options": {"num_samples": 256, "styles": ["plain", "gradient"]}}},
        "model": {"backbone": "tiny-pretrained:llava", "lora": {"rank": 8, "alpha": 16}},
        "architectures": {
            "small": {"clients": list(range(half)), "backbone": "tiny-pretrained:llava",
                      "clients_per_actor": max(1, -(-half // 2))},
            "large": {"clients": list(range(half, clients)), "backbone": "tiny-pretrained:llava-large",
                      "clients_per_actor": max(1, -(-(clients - half) // 2))}},
        "federation": {"rounds": 2, "clients_per_round": clients},
        "train": {"local_steps": local_steps, "batch_size": 4, "lr": 0.002, "optimizer": "adamw"},
        "methods": [entry], "placement": {"executor": "local"},
    }


def measure(clients: int, label: str, local_steps: int, grad_interval: int, rounds: int = 2) -> dict[str, Any]:
    config = load_config(setting(clients, METHODS[label], local_steps, grad_interval))
    built = time.perf_counter()
    actors = [ClientActor(config, slot.client_ids, architecture=slot.architecture) for slot in actor_slots(config)]
    driver = DriverActor(config)
    first: dict[str, tuple] = {}
    for actor in actors:
        shared = actor.start_method(0)
        first.setdefault(actor.architecture, (shared, actor.task_tags()))
    names = list(first)
    driver.start_method(0, names, *(first[n][0] for n in names), *(first[n][1] for n in names))
    setup_s = time.perf_counter() - built
    started = time.process_time()
    seen: dict[str, ClientActor] = {}
    for actor in actors:
        seen.setdefault(actor.architecture, actor)
    if declared(driver.method, PreFederationStage):
        driver.before_federation(names, *(seen[n].pre_federation(0) for n in names))
    alignment_s = time.process_time() - started
    per_round = []
    for round_idx in range(rounds):
        # CPU seconds of this (one-thread) process: what the work costs, whatever else shares the machine.
        timing = {"payload_s": 0.0, "train_s": 0.0}
        parts = []
        for actor in actors:
            t = time.process_time()
            payloads = driver.payloads(actor.client_ids)
            timing["payload_s"] += time.process_time() - t
            t = time.process_time()
            part = actor.train_round(round_idx, actor.client_ids, payloads, dict.fromkeys(actor.client_ids, 1.0))
            timing["train_s"] += time.process_time() - t
            parts.append(part)
        t = time.process_time()
        stats = driver.aggregate(*parts)
        timing["aggregate_s"] = time.process_time() - t
        timing["round_s"] = timing["payload_s"] + timing["train_s"] + timing["aggregate_s"]
        timing["up_params"] = stats["up_params"]
        timing["down_params"] = stats["down_params"]
        per_round.append(timing)
    last = per_round[-1]  # the first round builds optimizers and the aligned basis: the second is the steady state
    state_bytes = sum(tensor_bytes(actor.states) for actor in actors)
    frozen = {actor.architecture: sum(p.numel() * p.element_size() for p in actor.model.parameters()
                                      if not p.requires_grad) for actor in actors}
    return {"clients": clients, "method": label, "local_steps": local_steps, "setup_s": round(setup_s, 2),
            "alignment_s": round(alignment_s, 2),
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()},
            "train_s_per_client": round(last["train_s"] / clients, 4),
            "client_state_bytes_per_client": state_bytes // clients, "server_state_bytes": tensor_bytes(driver.server),
            "frozen_model_bytes": frozen, "rss_bytes": psutil.Process().memory_info().rss,
            "device": "cuda" if torch.cuda.is_available() else "cpu"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100, 1000])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--local-steps", type=int, default=None, help="default: 20 for 10 clients, else 2")
    parser.add_argument("--out", default="runs/fedmosaic_costs.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for clients in args.clients:
        steps = args.local_steps or (20 if clients <= 10 else 2)
        grad_interval = 5 if steps >= 20 else 1
        for label in args.methods:
            result = measure(clients, label, steps, grad_interval)
            results.append(result)
            print(json.dumps(result), flush=True)
            out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
