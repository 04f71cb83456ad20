"""A custom loss as a task kind: focal cross-entropy (Lin et al., 2017), with its expected calibration error as a
metric of its own, run with FedAvg.

    python examples/custom_loss.py [key.sub=value ...]

A task kind says what a task's samples become (``encode``), what the default model adds for it (``build_head``),
the loss of a training batch (``loss``) and how a test set is scored (``score``: sums over a batch, ``summarize``:
metrics from the sums). This one keeps classification's inputs, head and accuracy and replaces its loss; every
local step of every method then minimises it, and the run reports ``local_acc``, ``local_focal`` and ``local_ece``.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import rayfed
from rayfed.tasks.kinds import Classification

BINS = 10  # confidence bins of the calibration error


def focal_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float, reduction: str = "mean") -> torch.Tensor:
    """``-(1 - p_y)^gamma log p_y`` per sample (p_y: the softmax probability of the true class); gamma 0 is
    cross-entropy."""
    log_p = nn.functional.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    losses = -((1 - log_p.exp()) ** gamma) * log_p
    return losses.mean() if reduction == "mean" else losses.sum()


@rayfed.register_task_kind("focal")
class FocalClassification(Classification):
    """Classification trained with the focal loss; reports accuracy, the focal loss and the calibration error."""

    name = "focal"
    metrics = ("acc", "focal", "ece")
    primary = "acc"
    shared_metrics = ("acc", "ece")
    lower_is_better = frozenset({"focal", "ece"})

    def __init__(self, gamma: float = 2.0):
        if not gamma >= 0:
            raise ValueError(f"FocalClassification's gamma = {gamma!r} is invalid; allowed: a number >= 0.")
        self.gamma = gamma  # data.kind: focal builds the default; from Python, data.kind=FocalClassification(1.0)

    def loss(self, outputs, batch):
        return focal_loss(outputs, batch["labels"], self.gamma)

    def score(self, model, batch):
        logits, labels = model(batch).float(), batch["labels"]
        confidence, predicted = logits.softmax(dim=-1).max(dim=1)
        correct = (predicted == labels).float()
        bins = (confidence * BINS).long().clamp(max=BINS - 1)
        # Per confidence bin, the summed confidence minus the summed correctness: sums add up over test batches.
        gaps = torch.zeros(BINS, device=logits.device).index_add_(0, bins, confidence - correct)
        totals = torch.stack([correct.sum(), focal_loss(logits, labels, self.gamma, "sum")])
        correct_sum, focal_sum, *gap_sums = torch.cat([totals, gaps]).tolist()  # one read from the device
        return {"correct": correct_sum, "focal": focal_sum, **{f"gap{b}": gap for b, gap in enumerate(gap_sums)}}

    def summarize(self, sums, count):
        ece = sum(abs(sums[f"gap{b}"]) for b in range(BINS)) / count
        return {"acc": sums["correct"] / count, "focal": sums["focal"] / count, "ece": ece}


CONFIG = {
    "name": "custom_loss",
    "data": {"source": "sklearn:digits", "kind": "focal", "num_clients": 8,
             "partition": {"name": "dirichlet", "alpha": 0.5, "min_samples": 20}},
    "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}},
    "federation": {"rounds": 10, "clients_per_round": 4, "eval_every": 5},
    "train": {"local_steps": 5, "batch_size": 16, "lr": 0.005, "optimizer": "adam"},
    "methods": ["fedavg"],
    "placement": {"clients_per_actor": 4},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    summary = simulation.run()
    for label, result in summary["methods"].items():
        mean = result["mean"]
        print(f"{label}: local_acc = {mean['local_acc']:.4f}, local_focal = {mean['local_focal']:.4f}, "
              f"local_ece = {mean['local_ece']:.4f}")
    print(f"results: {simulation.run_dir}")
