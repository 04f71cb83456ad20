"""A per-client mixture written in the driver script: heuristic FedAMP, attentive message passing (Huang et al.,
"Personalized Cross-Silo Federated Learning on Non-IID Data", AAAI 2021, arXiv 2002.03043), run next to FedAvg.

    python examples/fedamp.py [key.sub=value ...]      # e.g. federation.rounds=30

The method declares ``aggregation = rayfed.Mixture(...)``: the engine keeps every client's latest upload w_j (the
server slot ``stacks``) and sends client i its own cloud model ``u_i = sum_j xi_ij w_j``. All the method computes is
xi: ``xi_ii = self_weight`` and, for j != i, the softmax over the other clients of ``sigma cos(w_i, w_j)`` times
``1 - self_weight``. Clients train from u_i with a proximal pull ``mu/2 ||w - u_i||^2`` towards it. For a run of one
architecture (each architecture's rows would need their own cosines).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import rayfed
from rayfed.training import proximal_penalty


@dataclass(frozen=True)
class FedAMPParams:
    self_weight: float = 0.5  # xi_ii: the share of a client's own model in its cloud model
    sigma: float = 5.0  # the attention's sharpness
    mu: float = 0.01  # the proximal pull towards the cloud model

    def __post_init__(self) -> None:
        if not 0 <= self.self_weight <= 1:
            raise ValueError("self_weight must be in [0, 1]")
        if self.mu < 0:
            raise ValueError("mu must be >= 0")


@rayfed.register_method("fedamp")
class FedAMP(rayfed.Method):
    """Each client's cloud model: its own upload and the others' by attention to them (xi, in the server state)."""

    Params = FedAMPParams
    aggregation = rayfed.Mixture(weights="attention/xi")

    def init_server(self, initial_shared):  # the engine's rows, and xi = I: round 1 starts from the initial model
        return {**super().init_server(initial_shared), "attention": {"xi": torch.eye(self.num_clients)}}

    def aggregate(self, server, uploads):  # the engine has written the uploads into their rows
        models = torch.cat([rows.flatten(1) for rows in server["stacks"].values()], dim=1).double()
        unit = models / models.norm(dim=1, keepdim=True).clamp_min(1e-12)
        own = torch.eye(len(unit), dtype=torch.bool)
        attention = torch.softmax((self.params.sigma * unit @ unit.T).masked_fill(own, -torch.inf), dim=1)
        xi = (1 - self.params.self_weight) * attention + self.params.self_weight * own
        return {**server, "attention": {"xi": xi.float()}}

    def local_penalty(self, payload):
        return proximal_penalty(payload, self.params.mu)


CONFIG = {
    "name": "fedamp",
    "data": {"source": "sklearn:digits", "num_clients": 8,
             "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 20}},
    "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}},
    "federation": {"rounds": 10, "clients_per_round": 4, "eval_every": 5},
    "train": {"local_steps": 5, "batch_size": 16, "lr": 0.005, "optimizer": "adam"},
    "methods": ["fedavg", {"name": "fedamp", "sigma": 5.0}],
    "placement": {"clients_per_actor": 4},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    summary = simulation.run()
    for label, result in summary["methods"].items():
        print(f"{label}: local_acc = {result['mean']['local_acc']:.4f}")
    print(f"results: {simulation.run_dir}")
