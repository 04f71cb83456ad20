"""Write the offline twin of every paper config: ``configs/<paper>/paper_<x>_offline.yaml`` beside ``paper_<x>.yaml``
(pFedMMA: ``<dataset>_offline.yaml`` beside ``<dataset>.yaml``). Run ``python benchmarks/papers/offline_twins.py
[--repo PATH]`` after changing a paper config or a setting here; ``tests/test_offline_twins.py`` fails until the
files match.

A twin is its paper config with two things replaced (docs/offline_models.md, "Offline twins"): every backbone by the
offline paper-size backbone of the same architecture (random init), and every hub dataset by a synthetic source of
the paper's shapes: image size, number of classes (answer vocabulary), text lengths, and the sample counts that set
a client's work where the config trains in local epochs. Clients, clients per round, rounds, local steps or epochs,
batch, optimizer, methods and their adapter / LoRA / prompt sizes, and placement are the paper config's, unchanged.
A twin measures what the paper's setting costs (memory, step time, communication) on a GPU host; its accuracies
mean nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from fedmosaic_configs import client_tasks
from repo_argument import configs_of, run_generator

# The paper's backbone (hub name) -> the offline backbone of its architecture at its size (rayfed/zoo/paper.py,
# rayfed/models/families/; open_clip:ViT-B-16 without model.pretrained is open_clip's own random init).
BACKBONES = {
    "hf:facebook/flava-full": "flava:full",
    "hf:dandelin/vilt-b32-mlm": "vilt:B32",
    "hf:thkim0305/llama3.2_1B_vl": "llava:llama-1B",
    "hf:thkim0305/llama3.2_3B_vl": "llava:llama-3B",
    "hf:WinKawaks/vit-tiny-patch16-224": "vit:T",
    "hf:WinKawaks/vit-small-patch16-224": "vit:S",
    "hf:google/vit-base-patch16-224-in21k": "vit:B",
    "hf:google/vit-large-patch16-224-in21k": "vit:L",
    "open_clip:ViT-B-16": "open_clip:ViT-B-16",
}

# Image datasets: classes, and the side and channels of the twin's images. The paper's own where its images are at
# most 64 px (CIFAR 32, FEMNIST 28 grey, TAP's resize to 64); 64 px where the paper stores them larger (CelebA
# 178 x 218, pFedMMA's and FedDAT's resize to 224 / 384), which the client model resizes to the backbone's input as
# it does the paper's: the model's cost is the same, the host memory of float images of 224 px and more is not.
IMAGES: dict[str, tuple[int, int, int]] = {
    "hf:uoft-cs/cifar100": (100, 32, 3),
    "hf:uoft-cs/cifar10": (10, 32, 3),
    "hf:flwrlabs/celeba": (2, 64, 3),
    "hf:flwrlabs/femnist": (62, 28, 1),
    "hf:zh-plus/tiny-imagenet": (200, 64, 3),
    "hf:ilee0022/Caltech-256": (257, 64, 3),
    "hf:zalando-datasets/fashion_mnist": (10, 64, 3),  # the paper's resize: 64 px, RGB
    "hf:flwrlabs/caltech101": (100, 64, 3),
    "hf:tanganke/dtd": (47, 64, 3),
    "hf:dpdl-benchmark/oxford_flowers102": (102, 64, 3),
    "hf:ethz/food101": (101, 64, 3),
    "hf:timm/oxford-iiit-pet": (37, 64, 3),
    "hf:tanganke/sun397": (397, 64, 3),
    "hf:flwrlabs/ucf101": (101, 64, 3),
    "hf:domainnet": (10, 64, 3),
    "hf:office_caltech10": (10, 64, 3),
}
# Samples of the twin's dataset where the partition or the local epochs make a client's work depend on it: the
# paper's (pFedMMA: CIFAR's train + test, DomainNet's and Office-Caltech10's 10-class subsets; FedYolo: the natural
# clients' average size in the paper's subset, CelebA 2.6% of 202,599 images over 787 clients, FEMNIST 1.8% of
# 805,263 over 532). Elsewhere enough for the partition and evaluation: twice what shards take, 40 per class
# (pFedMMA's 16 shots), 30 per class (TAP's image tasks).
SAMPLES = {"hf:uoft-cs/cifar100": 60_000, "hf:uoft-cs/cifar10": 60_000, "hf:domainnet": 22_851,
           "hf:office_caltech10": 2_533}
NATURAL_GROUPS = {"hf:flwrlabs/celeba": (787, 7), "hf:flwrlabs/femnist": (532, 27)}  # clients, samples each
DOMAINS = {"hf:domainnet": 6, "hf:office_caltech10": 4}
# What only the real dataset has: where it is, its columns, its images' size and how many of its rows are read (a
# subset, one frame a clip); the twin's synthetic source has the paper's shapes and sizes of its own.
HUB_KEYS = ("source", "path", "split", "image_column", "label_column", "text_column", "target_column", "resize",
            "max_samples", "one_per_group")


def synthetic_images(source: str, num_samples: int, writers: int | None = None) -> dict[str, Any]:
    """The ``synthetic`` source at ``source``'s classes and image shape; ``writers``: its natural groups."""
    classes, side, channels = IMAGES[source]
    options = {"num_samples": num_samples, "num_classes": classes, "image_size": side, "channels": channels}
    if writers is not None:
        options["num_writers"] = writers
    return {"source": "synthetic", "options": options}


def _without_hub(data: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if key not in HUB_KEYS}


def _grouped_partition(partition: dict[str, Any]) -> dict[str, Any]:
    """The paper's partition over the synthetic source's groups (its column ``writer``)."""
    return {**partition, "column": "writer"} if "column" in partition else partition


def image_classification(data: dict[str, Any]) -> dict[str, Any]:
    """A hub image-classification dataset (FedYolo's, pFedMMA's) -> ``synthetic`` of its shapes."""
    source = data["source"]
    classes = IMAGES[source][0]
    if source in NATURAL_GROUPS:
        clients, each = NATURAL_GROUPS[source]
        generator = synthetic_images(source, clients * each, writers=clients)
    elif source in DOMAINS:
        generator = synthetic_images(source, SAMPLES[source], writers=DOMAINS[source])
    elif data.get("partition", {}).get("name") == "base_novel":
        generator = synthetic_images(source, 40 * classes)
    elif data.get("partition", {}).get("name") == "shards":  # twice what the clients and the global test set take
        partition = data["partition"]
        taken = data["num_clients"] * (partition["samples_per_client"] + partition["test_samples_per_client"])
        generator = synthetic_images(source, 2 * (taken + partition.get("global_test_samples", 0)))
    else:
        generator = synthetic_images(source, SAMPLES[source])
    twin = {**generator, **_without_hub(data)}
    if "partition" in data:
        twin["partition"] = _grouped_partition(data["partition"])
    return twin


def fedyolo_data(data: dict[str, Any]) -> dict[str, Any]:
    if "tasks" in data:
        return {**data, "tasks": [image_classification(task) for task in data["tasks"]]}
    return image_classification(data)


def pfedmma_data(data: dict[str, Any]) -> dict[str, Any]:
    return image_classification(data)


# TAP (docs/tap.md): each archetype's dataset -> the synthetic task of the same kind (docs/offline_models.md).
TAP_TEXT = {
    "tap:ag_news": {"source": "multimodal:topics", "options": {"num_samples": 3600}},  # 4 topics, as AG News' 4
    "tap:vqav2": {"source": "multimodal:vqa", "options": {"num_samples": 1800, "image_size": 64}},  # tap:'s 64 px
    "tap:common_gen": {"source": "multimodal:description", "options": {"num_samples": 1800}},
}
MMLU_SUBJECTS = {"tap:mmlu/professional_law": "colors", "tap:mmlu/professional_medicine": "shapes",
                 "tap:mmlu/moral_scenarios": "numbers"}


def tap_task(task: dict[str, Any]) -> dict[str, Any]:
    source = task["source"]
    if source in TAP_TEXT:
        generator = copy.deepcopy(TAP_TEXT[source])
    elif source in MMLU_SUBJECTS:
        generator = {"source": "multimodal:multiple-choice",
                     "options": {"num_samples": 480, "subjects": [MMLU_SUBJECTS[source]]}}
    else:  # images at the paper's resize (64 px): classification, or reconstruction as in the paper
        generator = synthetic_images(source, 30 * IMAGES[source][0])
    return {"name": task["name"], **generator, **_without_hub(task)}


def tap_data(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "tasks": [tap_task(task) for task in data["tasks"]]}


# FedDAT (docs/feddat.md): one client per dataset, about 2,500 train + 500 test samples; the synthetic VQA of
# each client differs as the paper's benchmark does: render style and wording (Domain), question type (Function),
# render style (Scene). Its answers: the 20 of multimodal:vqa (the paper: each client's 100 most frequent).
FEDDAT_SAMPLES = 3000
FEDDAT_STYLES = ("plain", "gradient", "textured", "noisy", "sketch")
FEDDAT_FUNCTIONS = ("color", "shape", "count", "knowledge", "arithmetic")


def feddat_data(data: dict[str, Any], client_options: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    tasks = [{"name": task["name"], "source": "multimodal:vqa",
              "options": {"num_samples": FEDDAT_SAMPLES, "image_size": 64, **client_options(index)},
              **_without_hub(task)} for index, task in enumerate(data["tasks"])]
    return {**data, "tasks": tasks}


def feddat_domain(index: int) -> dict[str, Any]:
    return {"styles": [FEDDAT_STYLES[index]], "wording": index, "question_types": ["color"]}


def feddat_function(index: int) -> dict[str, Any]:
    return {"question_types": [FEDDAT_FUNCTIONS[index]]}


def feddat_scene(index: int) -> dict[str, Any]:
    return {"styles": [FEDDAT_STYLES[index % len(FEDDAT_STYLES)]], "question_types": ["color"]}


# FedMosaic (docs/fedmosaic.md): the offline benchmark's tasks (fedmosaic_configs.py) per client
# at 1,250 samples each, D_p's 5,000 public samples; texts hold LLaVA-1.5's 576 image tokens.
MOSAIC_SAMPLES_PER_TASK = 1250
MOSAIC_TEXT_LENGTH = 576 + 10  # the image tokens, <|begin_of_text|>, a question and its one-word answer
MOSAIC_PUBLIC = {"source": "multimodal:shapes", "kind": "text_generation", "max_text_length": 576 + 16,
                 "options": {"num_samples": 5000, "styles": ["plain", "gradient"]}}


def fedmosaic_data(data: dict[str, Any]) -> dict[str, Any]:
    """The paper's k-th task of client c -> the offline benchmark's k-th task of client c, under the paper's name."""
    tasks, seen = [], {}
    for paper_task in data["tasks"]:
        (client,) = paper_task["clients"]
        index = seen[client] = seen.get(client, -1) + 1
        task = client_tasks(client)[index]
        task.update(name=paper_task["name"], max_text_length=MOSAIC_TEXT_LENGTH)
        del task["test_fraction"]  # the paper config's default
        task["options"]["num_samples"] = MOSAIC_SAMPLES_PER_TASK
        tasks.append(task)
    return {**data, "tasks": tasks, "public": copy.deepcopy(MOSAIC_PUBLIC)}


def twin(paper: dict[str, Any], data: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """``paper`` with its data replaced by ``data(paper['data'])`` and every backbone by its offline equivalent."""
    config = copy.deepcopy(paper)
    config["name"] = f"{paper['name']}-offline"
    config["data"] = data(paper["data"])
    config["model"] = {key: value for key, value in config["model"].items() if key != "pretrained"}
    config["model"]["backbone"] = BACKBONES[paper["model"]["backbone"]]
    for architecture in (config.get("architectures") or {}).values():
        architecture["backbone"] = BACKBONES[architecture["backbone"]]
    for method in config["methods"]:
        if isinstance(method, dict) and "relevance_model" in method:
            method["relevance_model"] = BACKBONES[method["relevance_model"]]
    return config


PAPERS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "tap": ("TAP's archetypes on synthetic tasks of the paper's kinds, image sizes (64 px) and text lengths", tap_data),
    "feddat/paper_domain": ("one synthetic VQA client per dataset, each its own render style and wording",
                            lambda data: feddat_data(data, feddat_domain)),
    "feddat/paper_function": ("one synthetic VQA client per question type",
                              lambda data: feddat_data(data, feddat_function)),
    "feddat/paper_scene": ("one synthetic VQA client per scene (render style)",
                           lambda data: feddat_data(data, feddat_scene)),
    "fedmosaic": ("the offline benchmark's grouped VQA tasks (1,250 samples each, D_p of 5,000)",
                  fedmosaic_data),
    "fedyolo": ("the `synthetic` source at each dataset's classes, image size and client sizes", fedyolo_data),
    "pfedmma": ("the `synthetic` source at the dataset's classes, client sizes and domains", pfedmma_data),
}


def paper_configs(repo: Path) -> list[Path]:
    """Every paper config of ``repo``: ``configs/{tap,feddat,fedmosaic,fedyolo}/paper_*.yaml`` and pFedMMA's dataset
    configs."""
    configs = configs_of(repo)
    papers = [path for folder in ("tap", "feddat", "fedmosaic", "fedyolo")
              for path in sorted((configs / folder).glob("paper_*.yaml"))]
    papers += sorted((configs / "pfedmma").glob("*.yaml"))
    return [path for path in papers if not path.stem.startswith("offline") and not path.stem.endswith("_offline")]


def twin_path(paper: Path) -> Path:
    return paper.with_name(f"{paper.stem}_offline.yaml")


def _recipe(paper: Path) -> tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    relative = f"{paper.parent.name}/{paper.stem}"  # configs/<paper>/<name>.yaml
    return PAPERS.get(relative) or PAPERS[relative.split("/")[0]]


def twin_text(paper: Path) -> str:
    """The twin's file: a header and the YAML of :func:`twin`."""
    what, data = _recipe(paper)
    config = twin(yaml.safe_load(paper.read_text()), data)
    architectures = (config.get("architectures") or {}).values()
    backbones = sorted({config["model"]["backbone"], *(a["backbone"] for a in architectures)})
    relative = f"configs/{paper.parent.name}/{twin_path(paper).name}"
    header = (
        f"# Offline twin of {paper.name}: its clients, rounds, steps, batch, methods and adapter / LoRA / prompt "
        "sizes\n"
        f"# on {', '.join(backbones)} (paper-size, randomly initialised) and {what}.\n"
        "# Measures system cost at the paper's scale (memory, time, communication); accuracies mean nothing.\n"
        "# Generated by `python benchmarks/papers/offline_twins.py` from the paper config; docs/offline_models.md.\n"
        f"#   rayfed run {relative}\n"
    )
    return header + yaml.safe_dump(config, sort_keys=False, width=120, default_flow_style=None)


def write(repo: Path) -> list[Path]:
    """Write the twin of every paper config of ``repo``; the paths written."""
    written = []
    for paper in paper_configs(repo):
        path = twin_path(paper)
        path.write_text(twin_text(paper))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    run_generator(__doc__.splitlines()[0], write, argv)


if __name__ == "__main__":
    main()
