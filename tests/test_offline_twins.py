"""Every paper config (one that loads a model from the hub) has an offline twin beside it: the generator's output
(benchmarks/papers/offline_twins.py), valid offline, naming only offline paper-size backbones and synthetic sources,
with its paper config's federation, training, placement, methods and adapter / LoRA / prompt sizes, clients and task
layout, and the paper datasets' numbers of classes. Validation only: no model is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import offline_twins

from rayfed.config import DataConfig, RunConfig, load_config
from rayfed.registry import resolve

ROOT = Path(__file__).resolve().parents[1]

# The paper's backbone -> its offline twin's: the same architecture at the same size, randomly initialised (their
# shapes are checked against the published models in test_paper_backbones.py and test_fedyolo.py).
OFFLINE_BACKBONE = offline_twins.BACKBONES
# The classes of the papers' image-classification datasets (docs/fedyolo.md, docs/pfedmma.md, docs/tap.md).
PAPER_CLASSES = {
    "hf:uoft-cs/cifar100": 100, "hf:uoft-cs/cifar10": 10, "hf:flwrlabs/celeba": 2, "hf:flwrlabs/femnist": 62,
    "hf:zh-plus/tiny-imagenet": 200, "hf:flwrlabs/caltech101": 100, "hf:tanganke/dtd": 47,
    "hf:dpdl-benchmark/oxford_flowers102": 102, "hf:ethz/food101": 101, "hf:timm/oxford-iiit-pet": 37,
    "hf:tanganke/sun397": 397, "hf:flwrlabs/ucf101": 101, "hf:domainnet": 10, "hf:office_caltech10": 10,
}
OFFLINE_SOURCES = ("synthetic", "multimodal:", "task-groups:")
# What the twin may change in a data section: where the samples come from and how many there are, and the text
# length where the paper config leaves it to the backbone.
DATA_SOURCE_FIELDS = {"source", "options", "path", "split", "image_column", "label_column", "text_column",
                      "target_column", "resize", "max_samples", "one_per_group", "tasks", "public", "partition",
                      "max_text_length"}


def _loads_from_the_hub(raw: dict[str, Any]) -> bool:
    model = raw.get("model") or {}
    architectures = (raw.get("architectures") or {}).values()
    backbones = [model.get("backbone", ""), *((a or {}).get("backbone", "") for a in architectures)]
    return model.get("pretrained") is not None or any(str(b).startswith("hf:") for b in backbones)


PAPERS = sorted(path for path in (ROOT / "configs").rglob("*.yaml")
                if _loads_from_the_hub(yaml.safe_load(path.read_text()) or {}))


def _twin(paper: Path) -> Path:
    return paper.with_name(f"{paper.stem}_offline.yaml")


def _name(path: Path) -> str:
    return path.relative_to(ROOT / "configs").as_posix()


def test_the_twins_backbones_are_registered_offline_builders_not_hub_names():
    hub = resolve("backbone", "hf:any/model").obj
    for name in OFFLINE_BACKBONE.values():
        assert resolve("backbone", name).obj is not hub and not name.startswith("tiny"), name


def test_every_paper_config_has_a_twin_and_the_generator_knows_every_paper_config():
    assert len(PAPERS) >= 70  # TAP 2, FedDAT 3, FedMosaic 3, FedYolo 52, pFedMMA 11
    assert [p for p in PAPERS if not _twin(p).exists()] == []
    assert sorted(offline_twins.paper_configs(ROOT)) == PAPERS
    twins = sorted(p for p in (ROOT / "configs").rglob("*_offline.yaml"))
    assert twins == sorted(_twin(p) for p in PAPERS)  # and no twin without its paper config


@pytest.mark.parametrize("paper", PAPERS, ids=_name)
def test_the_twin_is_what_the_generator_writes_from_its_paper_config(paper):
    assert _twin(paper).read_text() == offline_twins.twin_text(paper), (
        f"{_name(_twin(paper))} is stale: run python benchmarks/papers/offline_twins.py")


def _sections(data: DataConfig) -> list[DataConfig]:
    return list(data.tasks) if data.tasks else [data]


def _backbones(config: RunConfig) -> list[str]:
    names = [config.model.backbone, *(a.backbone for a in (config.architectures or {}).values())]
    names += [m.params["relevance_model"] for m in config.methods if "relevance_model" in m.params]
    names += [m.model["backbone"] for m in config.methods if "backbone" in m.model]
    return [str(name) for name in names]


def _without(section: Any, fields: set[str]) -> dict[str, Any]:
    return {k: v for k, v in section.model_dump().items() if k not in fields}


@pytest.mark.parametrize("paper", PAPERS, ids=_name)
def test_the_twin_validates_offline_on_offline_models_and_data_and_keeps_its_paper_configs_sizes(paper):
    ours, theirs = load_config(_twin(paper)), load_config(paper)

    # models: each of the paper's backbones replaced by its offline equivalent, nothing loaded from the hub
    assert _backbones(ours) == [OFFLINE_BACKBONE[name] for name in _backbones(theirs)]
    assert ours.model.pretrained is None
    assert _without(ours.model, {"backbone", "pretrained"}) == _without(theirs.model, {"backbone", "pretrained"})
    assert {n: a.clients for n, a in (ours.architectures or {}).items()} == {
        n: a.clients for n, a in (theirs.architectures or {}).items()}

    # the federation, the training, the methods (with their adapter / LoRA / prompt sizes) and the placement
    assert (ours.seed, ours.imports, ours.federation, ours.train, ours.system, ours.placement) == (
        theirs.seed, theirs.imports, theirs.federation, theirs.train, theirs.system, theirs.placement)
    for mine, paper_entry in zip(ours.methods, theirs.methods, strict=True):
        params = {k: OFFLINE_BACKBONE[v] if k == "relevance_model" else v for k, v in paper_entry.params.items()}
        assert (mine.name, mine.label, mine.post_train_steps, mine.model, mine.params) == (
            paper_entry.name, paper_entry.label, paper_entry.post_train_steps, paper_entry.model, params)

    # data: the same tasks on the same clients with the same splits, text lengths and partitions, from offline
    # synthetic sources; image classification with the paper dataset's number of classes
    assert _without(ours.data, DATA_SOURCE_FIELDS) == _without(theirs.data, DATA_SOURCE_FIELDS)
    assert (ours.data.public is None) == (theirs.data.public is None)
    for mine, paper_section in zip(_sections(ours.data), _sections(theirs.data), strict=True):
        assert _without(mine, DATA_SOURCE_FIELDS) == _without(paper_section, DATA_SOURCE_FIELDS)
        partition = _without(paper_section.partition, {"column"})
        if partition["name"] == "presplit":  # the dataset's own train / test: a synthetic twin has none, cuts its own
            partition["name"] = "iid"
        assert _without(mine.partition, {"column"}) == partition
        if paper_section.max_text_length is not None:
            assert mine.max_text_length == paper_section.max_text_length
        if paper_section.source in PAPER_CLASSES:
            assert mine.source == "synthetic"
            assert mine.options["num_classes"] == PAPER_CLASSES[paper_section.source]
    for section in [*_sections(ours.data), *([ours.data.public] if ours.data.public else [])]:
        assert str(section.source).startswith(OFFLINE_SOURCES), section.source
        assert (section.path, section.split) == (None, None)
