"""Write ``configs/fedyolo/paper_*.yaml``: the scale & modularity study's experiments, one YAML each
(*Augmenting Federated Learning with Pretrained Transformers*, arXiv 2307.04905; docs/fedyolo.md#reproducing-the-paper).
Run ``python benchmarks/papers/fedyolo_configs.py [--repo PATH]`` after changing a setting here, then ``python
benchmarks/papers/offline_twins.py`` for their offline twins; tests load every file and regenerate them.

Every file runs unchanged with a network (HF datasets and ViT weights by name) and GPUs:
``rayfed run configs/fedyolo/paper_cifar100_B_mild.yaml --seed 0`` (the paper uses 5 seeds).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from repo_argument import configs_of, run_generator

# HF-format ViTs (patch 16, 224 px, no pooler used). The paper uses Google's augreg
# ImageNet-21k ViTs via timm; B and L are Google's in21k releases, T and S are HF conversions of
# the augreg timm weights (ImageNet-21k pretrained, ImageNet-1k fine-tuned).
BACKBONES = {
    "T": "hf:WinKawaks/vit-tiny-patch16-224",
    "S": "hf:WinKawaks/vit-small-patch16-224",
    "B": "hf:google/vit-base-patch16-224-in21k",
    "L": "hf:google/vit-large-patch16-224-in21k",
}
ROUNDS, STEPS_PER_EPOCH = 150, 4  # ceil(100 samples / batch 32)
HETEROGENEITY = {"homog": 100, "mild": 20, "hetero": 5}  # CIFAR-100 classes per client

CIFAR100 = {"source": "hf:uoft-cs/cifar100", "split": "train", "image_column": "img", "label_column": "fine_label"}
CIFAR10 = {"source": "hf:uoft-cs/cifar10", "split": "train", "image_column": "img", "label_column": "label"}
CELEBA = {"source": "hf:flwrlabs/celeba", "split": "train", "image_column": "image", "label_column": "Smiling",
          "num_clients": 787, "test_fraction": 0.5,
          "partition": {"name": "natural", "column": "celeb_id", "min_samples": 2, "max_group_size": 8}}
FEMNIST = {"source": "hf:flwrlabs/femnist", "split": "train", "image_column": "image", "label_column": "character",
           "num_clients": 532, "test_fraction": 0.5,
           "partition": {"name": "natural", "column": "writer_id", "min_samples": 2, "max_group_size": 120}}


# CIFAR-100's global accuracy (Fig 6, 9L; docs/fedyolo.md#data): 20 samples per class that no client holds.
GLOBAL_TEST_SAMPLES = 2000


def cifar(source: dict[str, Any], classes: int, global_test: int | None = None) -> dict[str, Any]:
    """20 clients x exactly 100 training samples of ``classes`` classes, 100 test samples of the same classes,
    and optionally a global test set of ``global_test`` samples over all classes."""
    partition = {"name": "shards", "classes_per_client": classes, "samples_per_client": 100,
                 "test_samples_per_client": 100}
    if global_test is not None:
        partition["global_test_samples"] = global_test
    return {**source, "num_clients": 20, "partition": partition}


def train(local_epochs: int) -> dict[str, Any]:
    """SGD (momentum 0.9), batch 32, lr 3e-2 with 100 warm-up steps then cosine to 0 over the run, clip 1.0."""
    return {"local_epochs": local_epochs, "batch_size": 32, "optimizer": "sgd", "momentum": 0.9, "lr": 0.03,
            "schedule": "warmup_cosine", "warmup_steps": 100,
            "decay_steps": ROUNDS * local_epochs * STEPS_PER_EPOCH, "grad_clip": 1.0}


def module(name: str) -> dict[str, Any]:
    return {"model": {"module": name}}


PERSONALIZE = 10 * STEPS_PER_EPOCH  # FedAvg+Local: 10 epochs of local fine-tuning after the last round
# An actor hosts 20 clients (a CIFAR run: one actor), 200 where the natural clients are hundreds (CelebA's 787,
# FEMNIST's 532: 4 and 3 actors, which one GPU holds), and asks for the GPU share its measured peak needs
# (gpus_per_actor: measured; no FedYolo actor's memory is recorded at paper size).
CLIENTS_PER_ACTOR, NATURAL_CLIENTS_PER_ACTOR = 20, 200

SINGLE_TASK_METHODS = [
    {"name": "local", "label": "local-adapter", **module("adapter")},
    *({"name": "fedavg", "label": f"fedavg-{m}", **module(m)} for m in ("full", "adapter", "lora", "vpt", "head")),
    {"name": "fedavg", "label": "fedavg-full+local", "post_train_steps": PERSONALIZE, **module("full")},
    {"name": "fedavg", "label": "fedavg-adapter+local", "post_train_steps": PERSONALIZE, **module("adapter")},
    {"name": "fedprox", "label": "fedprox-full", "mu": 0.1, **module("full")},
    {"name": "fedprox", "label": "fedprox-adapter", "mu": 0.1, **module("adapter")},
    {"name": "feddyn", "label": "feddyn-full", "alpha": 0.01, **module("full")},
    {"name": "feddyn", "label": "feddyn-adapter", "alpha": 0.01, **module("adapter")},
]
MULTITASK_METHODS = [
    {"name": "fedyolo", "label": "fedyolo", "sharing": "none"},
    {"name": "fedyolo", "label": "fedyolo-share-half", "sharing": "half"},
    {"name": "fedyolo", "label": "fedyolo-share-all", "sharing": "all"},
    {"name": "fedyolo", "label": "fedyolo+local", "sharing": "none", "post_train_steps": PERSONALIZE},
    {"name": "local", "label": "local-adapter"},
    {"name": "fedavg", "label": "fedavg-full", **module("full")},
    {"name": "fedavg", "label": "fedavg-full+local", "post_train_steps": PERSONALIZE, **module("full")},
    {"name": "fedprox", "label": "fedprox-full", "mu": 0.1, **module("full")},
]


def run(name: str, size: str, data: dict, methods: list, clients_per_round: int, local_epochs: int = 1) -> dict:
    return {
        "name": name,
        "seed": 0,
        "data": data,
        "model": {"backbone": BACKBONES[size], "module": "adapter", "adapter": {"dim": 8}, "vpt": {"prompts": 8},
                  "lora": {"rank": 8, "alpha": 8, "targets": ["q_proj", "v_proj"]}},
        "federation": {"rounds": ROUNDS, "clients_per_round": clients_per_round, "eval_every": 10,
                       "representation_shift": True},
        "train": train(local_epochs),
        "methods": copy.deepcopy(methods),
        "placement": {"clients_per_actor": CLIENTS_PER_ACTOR, "gpus_per_actor": "measured", "cpus_per_actor": 4},
    }


def natural(config: dict) -> dict:
    """``config`` with :data:`NATURAL_CLIENTS_PER_ACTOR` clients an actor (a run of hundreds of natural clients)."""
    config["placement"]["clients_per_actor"] = NATURAL_CLIENTS_PER_ACTOR
    return config


def task(name: str, data: dict, per_round: int) -> dict:
    return {"name": name, **data, "clients_per_round": per_round}


def configs() -> dict[str, tuple[str, dict]]:
    """File name -> (what it reproduces, config)."""
    out: dict[str, tuple[str, dict]] = {}
    for size in BACKBONES:
        for level, classes in HETEROGENEITY.items():
            out[f"paper_cifar100_{size}_{level}"] = (
                f"Fig 2-6, 15-16: CIFAR-100, {classes} classes per client, ViT-{size}, every update method and scheme",
                run(f"fedyolo-cifar100-{size}-{level}", size, cifar(CIFAR100, classes, GLOBAL_TEST_SAMPLES),
                    SINGLE_TASK_METHODS, 5))
        out[f"paper_cifar10_{size}_mild"] = (
            f"Table 1 task 1 alone: CIFAR-10, 2 classes per client, ViT-{size}",
            run(f"fedyolo-cifar10-{size}", size, cifar(CIFAR10, 2), SINGLE_TASK_METHODS, 5))
        out[f"paper_celeba_{size}"] = (
            f"Table 1 task 2 alone: CelebA smiling, one client per celebrity with <= 8 images, ViT-{size}",
            natural(run(f"fedyolo-celeba-{size}", size, CELEBA, SINGLE_TASK_METHODS, 79)))
        out[f"paper_femnist_{size}"] = (
            f"Table 1 task 3 alone: FEMNIST, one client per writer with <= 120 samples, ViT-{size}",
            natural(run(f"fedyolo-femnist-{size}", size, FEMNIST, SINGLE_TASK_METHODS, 53)))
        for epochs in (1, 5, 10, 20):
            out[f"paper_epochs_{size}_E{epochs}"] = (
                f"Fig 7: local epochs E={epochs}, CIFAR-100 mild heterogeneity, ViT-{size}, full vs adapter",
                run(f"fedyolo-epochs-{size}-E{epochs}", size, cifar(CIFAR100, 20),
                    [m for m in SINGLE_TASK_METHODS if m["label"] in ("fedavg-full", "fedavg-adapter")], 5, epochs))
        tasks = [task("cifar100", cifar(CIFAR100, 20, GLOBAL_TEST_SAMPLES), 5), task("cifar10", cifar(CIFAR10, 2), 5),
                 task("celeba", CELEBA, 79), task("femnist", FEMNIST, 53)]
        for count in (2, 3, 4):
            chosen = tasks[:count]
            label = "".join(str(i) for i in range(count))
            multitask = run(f"fedyolo-tasks{label}-{size}", size, {"tasks": chosen}, MULTITASK_METHODS,
                            sum(t["clients_per_round"] for t in chosen))
            natural(multitask)
            out[f"paper_fedyolo_{size}_tasks{label}"] = (
                f"Fig 9-12: FedYolo vs FedAvg on tasks {{{', '.join(label)}}}, task 0 = CIFAR-100, ViT-{size}",
                multitask)
    return out


def write(repo: Path) -> list[Path]:
    """Write every experiment's file under ``repo``'s ``configs/fedyolo/``; the paths written."""
    out = configs_of(repo) / "fedyolo"
    written = []
    for name, (what, config) in configs().items():
        header = (f"# Reproduces {what}.\n"
                  "# Generated by benchmarks/papers/fedyolo_configs.py; docs/fedyolo.md explains the settings.\n")
        written.append(out / f"{name}.yaml")
        written[-1].write_text(header + yaml.safe_dump(config, sort_keys=False))
    return written


def main(argv: list[str] | None = None) -> None:
    run_generator(__doc__.splitlines()[0], write, argv)


if __name__ == "__main__":
    main()
