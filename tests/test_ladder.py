"""FedYolo's offline scale ladder (docs/fedyolo.md#offline-results-on-the-scale-ladder): part-texture data and the
pretrained ViT sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors
import torch
import transformers

from rayfed import zoo
from rayfed.config import ModelConfig
from rayfed.data.sources import DataError

from conftest import load_data
from rayfed.methods.fedyolo import ladder, parts
from rayfed.models import build_backbone, build_client_model
from rayfed.zoo import cache

LADDER_SIZES = {  # d, blocks, heads, MLP width
    "t": (48, 3, 3, 192),
    "s": (96, 4, 3, 384),
    "b": (192, 6, 6, 768),
}
QUICK_LADDER = {"train": {"steps": 3, "batch_size": 8}, "data": {"train_samples": 512, "eval_samples": 64}}


def _pairs(layout: np.ndarray) -> set[tuple[int, int]]:
    return {(int(cell), int(part)) for cell, part in layout}


def test_downstream_classes_are_new_layouts_of_the_upstream_parts() -> None:
    world = parts.world(0)
    upstream = {frozenset(_pairs(layout)) for layout in world.upstream}
    fine = [_pairs(layout) for layout in world.fine]
    assert len(upstream) == parts.UPSTREAM_CLASSES and len({frozenset(f) for f in fine}) == parts.FINE_CLASSES
    assert not upstream & {frozenset(f) for f in fine}
    for layout in [*world.upstream, *world.fine]:
        assert len({int(cell) for cell, _ in layout}) == parts.PARTS_PER_CLASS  # one part per cell
    per_group = parts.FINE_CLASSES // parts.COARSE_CLASSES
    cores = [set.intersection(*fine[g * per_group : (g + 1) * per_group]) for g in range(parts.COARSE_CLASSES)]
    assert all(len(core) >= 2 for core in cores)  # a super-class's classes share its two core pairs
    assert len({frozenset(core) for core in cores}) == parts.COARSE_CLASSES


def test_render_is_seeded_balanced_and_keeps_the_world() -> None:
    images, labels = parts.render(300, label_space="fine", seed=1)
    again, labels_again = parts.render(300, label_space="fine", seed=1)
    other, _ = parts.render(300, label_space="fine", seed=2)
    assert images.dtype == np.float32 and images.shape == (300, 32, 32, 3)
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert np.array_equal(images, again) and np.array_equal(labels, labels_again)
    assert not np.array_equal(images, other)
    assert np.bincount(labels).tolist() == [3] * parts.FINE_CLASSES
    _, coarse = parts.render(50, label_space="coarse", seed=1)
    assert np.bincount(coarse).tolist() == [5] * parts.COARSE_CLASSES
    world_before = parts.world(0).fine.copy()
    parts.render(10, label_space="upstream", seed=3)
    assert np.array_equal(parts.world(0).fine, world_before)


def test_parts_source_and_its_errors() -> None:
    dataset = load_data("parts", seed=0, synthetic={"num_samples": 40, "label_space": "coarse"})
    assert dataset.class_names == parts.class_names("coarse") and len(dataset) == 40
    with pytest.raises(DataError, match=r"data\.options\.label_space = 'medium'.*upstream, fine, coarse"):
        load_data("parts", synthetic={"label_space": "medium"})
    with pytest.raises(DataError, match=r"data\.options\.world = -1"):
        load_data("parts", synthetic={"world": -1})
    with pytest.raises(DataError, match=r"no option 'classes'"):
        load_data("parts", synthetic={"classes": 3})


def test_a_fresh_process_finds_the_parts_source_and_the_ladder_families_by_name() -> None:
    """They live in the FedYolo package, which the engine never imports: the registry's look-up of built-in sources
    and backbones (and so the zoo's of its families) imports it, on the driver and on every actor alike."""
    script = (
        "from rayfed import registry, zoo\n"
        "print([f for f in zoo.FAMILIES if f.startswith('vit-ladder-')], 'parts' in registry.names('source'),\n"
        "      registry.resolve('source', 'parts').obj.__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    families, parts_found, module = result.stdout.splitlines()[0].rsplit(" ", 2)
    assert (families, parts_found, module) == ("['vit-ladder-t', 'vit-ladder-s', 'vit-ladder-b']", "True",
                                               "rayfed.methods.fedyolo.parts")


@pytest.mark.parametrize("size", "tsb")
def test_ladder_sizes_and_one_budget_are_the_documented_ones(size: str) -> None:
    recipe = zoo.recipe(f"vit-ladder-{size}")
    d, blocks, heads, mlp = LADDER_SIZES[size]
    assert recipe["model"] == {"hidden_size": d, "num_hidden_layers": blocks, "num_attention_heads": heads,
                               "intermediate_size": mlp, "image_size": 32, "patch_size": 4}  # fmt: skip
    assert recipe["train"] == zoo.recipe("vit-ladder-t")["train"] and recipe["data"] == zoo.recipe("vit-ladder-t")["data"]
    assert recipe["data"]["train_samples"] >= 100 * 200  # >= 200 upstream classes, ~100 images each


def test_shipped_sizes_load_without_a_build_and_pass_the_gate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """T' and S' ship with rayfed; upstream and linear-probe accuracy grow with size (our gate, docs/fedyolo.md#offline-results-on-the-scale-ladder)."""
    monkeypatch.setenv("RAYFED_CACHE", str(tmp_path))
    monkeypatch.setattr(cache, "_build", lambda *args: pytest.fail("built a shipped model"))
    manifests = []
    for size in "ts":
        folder = zoo.pretrained(f"vit-ladder-{size}")
        assert folder.parent == cache.PACKAGED and zoo.shipped(f"vit-ladder-{size}")
        manifests.append(zoo.read_manifest(folder))
    assert manifests[0]["params"] < manifests[1]["params"]
    for metric in ("accuracy", "probe_acc"):
        assert manifests[0]["metrics"]["after"][metric] <= manifests[1]["metrics"]["after"][metric], metric
    backbone = build_backbone(ModelConfig(backbone="tiny-pretrained:vit-ladder-s"), seed=0)
    assert (backbone.feature_dim, backbone.image_size) == (96, 32)
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in backbone.encoder.parameters())
    assert "vit-ladder-b" not in zoo.default_families() or zoo.shipped("vit-ladder-b")


def test_a_ladder_recipe_builds_into_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAYFED_CACHE", str(tmp_path))
    folder = zoo.pretrained("vit-ladder-t", QUICK_LADDER)
    assert folder.parent == tmp_path / "pretrained"
    manifest = zoo.read_manifest(folder)
    assert manifest["recipe"] == zoo.recipe("vit-ladder-t", QUICK_LADDER) and manifest["params"] > 0
    with safetensors.safe_open(folder / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.float16}
    encoder = ladder.load(str(folder)).model
    assert type(encoder) is transformers.ViTModel and next(encoder.parameters()).dtype == torch.float32
    assert zoo.evaluate("vit-ladder-t", folder) == manifest["metrics"]["after"]


@pytest.mark.parametrize("num_classes", [100, 10])
def test_ladder_module_counts_and_uplink_ratio(num_classes: int) -> None:
    """The study's per-block formulas on S'; the full / adapter ratio the docs quote (28.8x, 61.0x)."""
    d, blocks = 96, 4
    backbone = build_backbone(ModelConfig(backbone="tiny-pretrained:vit-ladder-s"), seed=0)
    counts = {}
    for module in ("full", "adapter", "vpt", "head"):
        model = build_client_model(backbone, ModelConfig(backbone="tiny-pretrained:vit-ladder-s", module=module),
                                   num_classes, 0)  # fmt: skip
        counts[module] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    head = num_classes * d + num_classes
    assert counts["head"] == head
    assert counts["adapter"] == blocks * (17 * d + 8) + head and counts["vpt"] == blocks * 8 * d + head
    assert counts["full"] == sum(p.numel() for p in backbone.encoder.parameters()) + head
    assert round(counts["full"] / counts["adapter"], 1) == {100: 28.8, 10: 61.0}[num_classes]


def test_tables_report_the_uplink_cost_at_the_target(tmp_path: Path) -> None:
    """Rounds to 95% of fedavg-full's best, the uplink sent until then, and full's cost over the method's."""
    from fedyolo_tables import tables

    per_round = {"fedavg-full": 1000, "fedavg-head": 10}
    accuracy = {"fedavg-full": [0.5, 0.8, 1.0], "fedavg-head": [0.96, 0.97, 0.97]}  # evaluated every 2 rounds
    events = []
    for label, up in per_round.items():
        events += [{"event": "round", "method": label, "round": r, "up_params": up} for r in range(1, 7)]
        events += [{"event": "eval", "method": label, "round": 2 * i + 2, "local_acc": acc}
                   for i, acc in enumerate(accuracy[label])]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = {
        "config": {"methods": [{"label": label, "post_train_steps": 0} for label in per_round],
                   "federation": {"rounds": 6, "target_acc": None}},
        "methods": {label: {"mean": {"local_acc": accuracy[label][-1]}} for label in per_round},
        "comm_params": {label: {"up": 6 * up} for label, up in per_round.items()},
    }  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in tables([tmp_path]).splitlines()]
    rows = {row[0]: row for row in cells}
    assert rows["fedavg-full"][5:8] == ["6", "6,000", "1.0x (1 of 1)"]  # target 0.95: reached at round 6
    assert rows["fedavg-head"][4:8] == ["100.0x", "2", "20", "300.0x (1 of 1)"]


def test_tables_give_the_forgetting_ratio_on_the_global_test_set(tmp_path: Path) -> None:
    from fedyolo_tables import tables

    global_acc = {"fedavg-full": 0.8, "fedavg-full+local": 0.6}
    (tmp_path / "metrics.jsonl").write_text("")
    summary = {
        "config": {"methods": [{"label": "fedavg-full", "post_train_steps": 0},
                               {"label": "fedavg-full+local", "post_train_steps": 5}],
                   "federation": {"rounds": 1, "target_acc": None}},
        "methods": {label: {"mean": {"local_acc": 0.9, "global_acc": acc}} for label, acc in global_acc.items()},
        "comm_params": {label: {"up": 10} for label in global_acc},
    }  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert "| fedavg-full | 80.0 ± 0.0 | 60.0 ± 0.0 | 0.250 ± 0.000 |" in tables([tmp_path]).splitlines()


@pytest.mark.parametrize("name", ["offline_ladder.yaml", "offline_ladder_multitask.yaml"])
def test_the_ladder_configs_use_a_shipped_backbone_and_the_papers_partitions(name: str) -> None:
    from rayfed.config import load_config
    from rayfed.data.clients import build_federation

    config = load_config(Path(__file__).parents[1] / "configs" / "fedyolo" / name)
    assert zoo.shipped(config.model.backbone.removeprefix("tiny-pretrained:"))
    federation = build_federation(config.data, config.seed)
    for part, classes in zip(federation.holdings, (20, 2)):  # fine, then coarse
        assert len(part.splits) == 20
        for train, test in part.splits:
            assert len(train) == 100 and len(test) == 100
            assert len(np.unique(part.dataset.labels[train])) == classes
