"""Bring your own client model: what every method trains over the frozen backbone, chosen by ``model.client``.

    python examples/custom_client_model.py [key.sub=value ...]

A client-model builder is called with a ``ClientModelRequest`` (the backbone, the method's model config, the
run's tasks and a seed) and returns a ``rayfed.TrainableModule`` whose trainable parameters are what clients
train and send. This one is the engine's model with a residual bottleneck on the backbone's features before the
heads, of width ``model.client_options.rank``; methods that build no model of their own (FedAvg, Ditto,
Per-FedAvg, ...) train it unchanged.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import rayfed
from rayfed.errors import ConfigError
from rayfed.models import default_client_model


class Bottleneck(nn.Module):
    """``x + up(relu(down(x)))``, starting as the identity (``up`` is zero)."""

    def __init__(self, width: int, rank: int):
        super().__init__()
        self.down, self.up = nn.Linear(width, rank), nn.Linear(rank, width)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features + self.up(nn.functional.relu(self.down(features)))


@rayfed.register_client_model("feature-bottleneck")
def feature_bottleneck(request: rayfed.ClientModelRequest) -> rayfed.TrainableModule:
    """The engine's model (model.module and a head per task) with a bottleneck of width ``rank`` before the heads."""
    options = request.options
    unknown = sorted(set(options) - {"rank"})
    if unknown:
        raise ConfigError(f"model.client_options has no option {unknown[0]!r}; allowed: rank.")
    rank = options.get("rank", 8)
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"model.client_options.rank = {rank!r} is invalid: it must be an integer >= 1.")
    model = default_client_model(request)
    torch.manual_seed(request.seed)  # the same initial values on every actor
    model.head = nn.Sequential(Bottleneck(request.backbone.feature_dim, rank), model.head)
    return model


CONFIG = {
    "name": "custom_client_model",
    "data": {"source": "sklearn:digits", "num_clients": 8, "partition": {"name": "shards", "classes_per_client": 3}},
    # the tiny ViT frozen; what trains: the bottleneck and the heads (model.module: head adds nothing else)
    "model": {"backbone": "tiny:vit", "image_size": 8, "module": "head",
              "client": "feature-bottleneck", "client_options": {"rank": 16}},
    "federation": {"rounds": 8, "clients_per_round": 4, "eval_every": 4},
    "train": {"local_steps": 4, "batch_size": 16, "lr": 0.01, "optimizer": "adam"},
    "methods": ["local", "fedavg", "ditto"],
    "placement": {"clients_per_actor": 4},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    means = {label: result["mean"] for label, result in simulation.run()["methods"].items()}
    print(" | ".join(f"{label}: local_acc = {mean['local_acc']:.4f}" for label, mean in means.items()))
    print(f"results: {simulation.run_dir}")
