"""A new method written in the driver script: FedAvg with server momentum (FedAvgM, Hsu et al., 2019),
run next to FedAvg on the same clients.

    python examples/custom_method.py [key.sub=value ...]      # e.g. federation.rounds=30

The method is registered under a name (``fedavgm``) that the config uses like a built-in one; Ray ships
the class to every actor, so nothing needs to be installed or importable there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import rayfed
from rayfed.method import weighted_mean


@dataclass(frozen=True)
class FedAvgMParams:
    momentum: float = 0.9  # beta
    server_lr: float = 1.0  # eta

    def __post_init__(self) -> None:
        if not 0 <= self.momentum < 1:
            raise ValueError("momentum must be in [0, 1)")
        if not self.server_lr > 0:
            raise ValueError("server_lr must be > 0")


@rayfed.register_method("fedavgm")
class FedAvgM(rayfed.Method):
    """FedAvg with server momentum: v <- beta v + (mean of the uploads - w), w <- w + eta v."""

    Params = FedAvgMParams
    aggregation = rayfed.WeightedMean()  # the update needs only the uploads' weighted mean: actors pre-sum them

    def init_server(self, initial_shared):
        return {"global": initial_shared, "velocity": {n: torch.zeros_like(v) for n, v in initial_shared.items()}}

    def aggregate(self, server, uploads):
        uploaded = [u for u in uploads if u.tensors.get("shared")]
        if not uploaded:
            return server
        mean = weighted_mean(uploaded, "shared")
        velocity = dict(server["velocity"])
        weights = dict(server["global"])
        for name, value in mean.items():
            velocity[name] = self.params.momentum * velocity[name] + (value - weights[name])
            weights[name] = weights[name] + self.params.server_lr * velocity[name]
        return {"global": weights, "velocity": velocity}


CONFIG = {
    "name": "custom_method",
    "data": {"source": "sklearn:digits", "num_clients": 8,
             "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 20}},
    "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}},
    "federation": {"rounds": 10, "clients_per_round": 4, "eval_every": 5},
    "train": {"local_steps": 5, "batch_size": 16, "lr": 0.005, "optimizer": "adam"},
    "methods": ["fedavg", {"name": "fedavgm", "momentum": 0.5}],
    "placement": {"clients_per_actor": 4},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    summary = simulation.run()
    for label, result in summary["methods"].items():
        print(f"{label}: local_acc = {result['mean']['local_acc']:.4f}")
    print(f"results: {simulation.run_dir}")
