"""FedRep (Collins et al., 2021), written from outside the engine: clients share the representation (here the
encoder's LoRA) and keep their own head. Each local update trains the head with the body fixed, then the body with
the new head fixed; only the body is uploaded and averaged.

    python examples/fedrep.py [key.sub=value ...]      # e.g. federation.rounds=30

It shows partial-parameter training (docs/extending.md, "Training part of the parameters"): two `client.train`
calls, each with its own `purpose` (its own batches) and a `Phase(trains=...)` that selects what it updates.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import rayfed
from rayfed.method import LocalResult
from rayfed.param_names import components
from rayfed.training import Phase


def is_head(name: str) -> bool:
    """The default model's head: ``head.weight`` / ``head.bias`` (one task) or ``head.task_<i>.*`` (several)."""
    return components(name)[0] == "head"


@dataclass(frozen=True)
class FedRepParams:
    head_steps: int = 10  # tau_h: the head's steps a round, the body fixed
    body_steps: int | None = None  # the body's steps a round, the head fixed (default: train.local_steps)

    def __post_init__(self) -> None:
        if self.head_steps <= 0:
            raise ValueError("head_steps must be > 0")
        if self.body_steps is not None and self.body_steps <= 0:
            raise ValueError("body_steps must be > 0")


@rayfed.register_method("fedrep")
class FedRep(rayfed.Method):
    """A shared representation, a personal head: head steps, then body steps; the body is averaged."""

    Params = FedRepParams

    def is_shared(self, name: str) -> bool:  # the default init_client keeps the rest, the head, as "personal"
        return not is_head(name)

    def local_update(self, client, state, payload):
        start = {**state["personal"], **(payload or {})}
        head = client.train(start, steps=self.params.head_steps, purpose="head", phases=[Phase(trains=is_head)])
        body = client.train(head.params, steps=self.params.body_steps, purpose="body",
                            phases=[Phase(trains=self.is_shared)])
        shared, personal = self.split(body.params)
        return LocalResult({**state, "personal": personal}, {"shared": shared}, body.loss)


CONFIG = {
    "name": "fedrep",
    "data": {"source": "sklearn:digits", "num_clients": 8,
             "partition": {"name": "dirichlet", "alpha": 0.3, "min_samples": 20}},
    "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}},
    "federation": {"rounds": 10, "clients_per_round": 4, "eval_every": 5},
    "train": {"local_steps": 5, "batch_size": 16, "lr": 0.005, "optimizer": "adam"},
    "methods": ["fedavg", {"name": "fedrep", "head_steps": 5}],
    "placement": {"clients_per_actor": 4},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    summary = simulation.run()
    for label, result in summary["methods"].items():
        print(f"{label}: local_acc = {result['mean']['local_acc']:.4f}")
    print(f"results: {simulation.run_dir}")
