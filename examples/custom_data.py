"""Bring your own data: a function returning arrays, registered as a data source, and your own partitioner.

    python examples/custom_data.py [key.sub=value ...]

A source is called with a ``SourceRequest`` (the run's seed, ``data.options``, ...) and returns a dict of
columns (``image``: (N, H, W[, C]) uint8 or [0, 1] floats, ``label``, or ``text``/``target`` for text tasks),
an ``(images, labels)`` pair, or a ``datasets.Dataset``. A partitioner is called with a
``PartitionRequest`` and returns one array of sample indices per client.
"""

from __future__ import annotations

import sys

import numpy as np

import rayfed


@rayfed.register_source("noisy-digits")
def noisy_digits(request: rayfed.SourceRequest) -> dict:
    """scikit-learn's digits with seeded Gaussian noise of std ``noise`` (data.options)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(request.seed)
    noise = float(request.options.get("noise", 0.1))
    images = np.clip(digits.images / 16.0 + rng.normal(0.0, noise, digits.images.shape), 0.0, 1.0)
    return {"image": images.astype(np.float32), "label": digits.target,
            "class_names": [str(d) for d in range(10)]}


@rayfed.register_partitioner("label-pairs")
def label_pairs(request: rayfed.PartitionRequest) -> list[np.ndarray]:
    """Labels go in pairs (0-1, 2-3, ...); client c holds pair c mod P, split evenly with the clients sharing it."""
    num_pairs = (int(request.labels.max()) + 2) // 2
    pair_of_sample = request.labels // 2
    clients: list[np.ndarray] = [np.empty(0, np.int64)] * request.num_clients
    rng = request.rng(7)  # a seeded stream of its own
    for pair in range(num_pairs):
        holders = [c for c in range(request.num_clients) if c % num_pairs == pair]
        members = rng.permutation(np.flatnonzero(pair_of_sample == pair))
        for client, part in zip(holders, np.array_split(members, max(len(holders), 1))):
            clients[client] = part
    return clients


CONFIG = {
    "name": "custom_data",
    "data": {"source": "noisy-digits", "options": {"noise": 0.2}, "num_clients": 10,
             "partition": {"name": "label-pairs"}},
    "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}},
    "federation": {"rounds": 10, "clients_per_round": 5, "eval_every": 5},
    "train": {"local_steps": 5, "batch_size": 16, "lr": 0.005, "optimizer": "adam"},
    "methods": ["local", "fedavg", {"name": "fedavg", "post_train_steps": 10}],
    "placement": {"clients_per_actor": 5},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    summary = simulation.run()
    for label, result in summary["methods"].items():
        print(f"{label}: local_acc = {result['mean']['local_acc']:.4f}")
    print(f"results: {simulation.run_dir}")
