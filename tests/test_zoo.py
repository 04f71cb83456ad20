"""rayfed.zoo: tiny pretrained models of every family.

Most families ship built (``rayfed/zoo/weights``, float16): their tests load the shipped folders, which
must match the current recipes, and never build them. The build path is tested once per family kind on
a reduced recipe (seconds), twice, for bit-identical weights. Families that do not ship
(open_clip's, whose 49,408-row BPE table would not fit the shipped-size budget) build at first use; their
full default builds (about 30 s and 3 min on a CPU) run when ``RAYFED_TEST_FULL_BUILDS=1``.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import open_clip
import pytest
import safetensors.torch
import torch
import transformers

from rayfed import zoo
from rayfed.cli import main
from rayfed.config import ModelConfig
from rayfed.data import multimodal as mm
from rayfed.errors import ConfigError
from rayfed.models import build_backbone
from rayfed.zoo import cache, llava
from rayfed.zoo.tokenizers import load_tokenizer, word_tokenizer

# (metric, the pretrained model must reach at least, the random one stays below); lower-is-better
# metrics (perplexities) are written with their bounds swapped.
CLEAR_GAINS: dict[str, list[tuple[str, float, float]]] = {
    "clip": [("zeroshot_acc", 0.4, 0.1), ("novel_zeroshot_acc", 0.5, 0.2)],
    "open_clip": [("zeroshot_acc", 0.35, 0.1), ("novel_zeroshot_acc", 0.5, 0.2)],
    "open_clip-deep": [("zeroshot_acc", 0.25, 0.1), ("novel_zeroshot_acc", 0.5, 0.2)],
    "clip-vision": [("probe_acc", 0.08, 0.06)],
    "vit": [("accuracy", 0.35, 0.1)],
    "vilt": [("mlm_acc", 0.35, 0.05)],
    "flava": [("mmm_acc", 0.4, 0.05), ("itm_acc", 0.85, 0.6), ("zeroshot_acc", 0.15, 0.05)],
    "llama-small": [("perplexity", 4.0, 100.0)],
    "llama-large": [("perplexity", 4.0, 100.0)],
    "qwen": [("perplexity", 4.0, 100.0)],
    "llava": [("attribute_acc", 0.5, 0.1), ("caption_perplexity", 2.0, 100.0)],
    "llava-large": [("attribute_acc", 0.5, 0.1), ("caption_perplexity", 2.0, 100.0)],
    **{f"vit-ladder-{size}": [("accuracy", 0.9, 0.05), ("probe_acc", 0.85, 0.45)] for size in "tsb"},
}
LOWER_IS_BETTER = {"perplexity", "caption_perplexity"}
LOADED_CLASSES = {
    "clip": transformers.CLIPModel,
    "clip-vision": transformers.CLIPVisionModel,
    "open_clip": open_clip.CLIP,
    "open_clip-deep": open_clip.CLIP,
    "vit": transformers.ViTModel,
    "vilt": transformers.ViltModel,
    "flava": transformers.FlavaModel,
    "llama-small": transformers.LlamaForCausalLM,
    "llama-large": transformers.LlamaForCausalLM,
    "qwen": transformers.Qwen2ForCausalLM,
    "llava": transformers.LlavaForConditionalGeneration,
    "llava-large": transformers.LlavaForConditionalGeneration,
    **{f"vit-ladder-{size}": transformers.ViTModel for size in "tsb"},
}
SHIPPED = [
    "vit", "clip", "clip-vision", "vilt", "flava", "llama-small", "llama-large", "qwen", "llava", "llava-large",
    "vit-ladder-t", "vit-ladder-s",
]  # fmt: skip
SHIPPED_BYTES_LIMIT = 10 * 10**6  # the working tree travels to GPU hosts under a 64 MiB limit
# Families that build at first use (not shipped, not GPU-scale).
UNSHIPPED = [family for family in zoo.default_families() if family not in SHIPPED]
FULL_BUILDS = os.environ.get("RAYFED_TEST_FULL_BUILDS") == "1"
# A recipe small enough to build in seconds, for the tests of the cache machinery.
QUICK_VIT = {"train": {"steps": 3, "batch_size": 8}, "data": {"train_samples": 64, "eval_samples": 64}}
# One rebuild per family kind, on a reduced recipe (seconds): enough steps to beat the random initialization.
REDUCED = {"train": {"steps": 40, "batch_size": 32}, "data": {"train_samples": 512, "eval_samples": 256}}
REBUILDS: dict[str, dict[str, Any]] = {
    "vit": REDUCED,  # image encoder
    "open_clip": REDUCED,  # image-text contrastive (the kind's family that does not ship)
    # image-text fusion encoder: masked words need the image, which takes ViLT ~150 steps to start using
    "vilt": {"train": {"steps": 200, "batch_size": 32}, "data": {"train_samples": 2048, "eval_samples": 256}},
    # causal LM (Qwen2: qkv bias, and the tokenizer path AutoTokenizer would garble)
    "qwen": {"train": {"steps": 40, "batch_size": 16}, "data": {"train_samples": 512, "eval_samples": 128}},
    # multi-modal LLM, from the shipped clip-vision tower and llama-small
    "llava": {"train": {"steps": 60, "batch_size": 16}, "data": {"train_samples": 512, "eval_samples": 128}},
}


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAYFED_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def no_builds(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache in which building any model fails the test."""
    monkeypatch.setattr(cache, "_build", lambda *args: pytest.fail(f"built {args[0]}"))
    return fresh_cache


def assert_clear_gain(family: str, metrics: dict[str, dict[str, float]]) -> None:
    before, after = metrics["before"], metrics["after"]
    for metric, good, bad in CLEAR_GAINS[family]:
        if metric in LOWER_IS_BETTER:
            assert after[metric] <= good and before[metric] >= bad, (metric, before[metric], after[metric])
        else:
            assert after[metric] >= good and before[metric] <= bad, (metric, before[metric], after[metric])


def float_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in [*model.parameters(), *model.buffers()] if p.is_floating_point()}


def test_families_cover_every_model_the_methods_use() -> None:
    assert set(zoo.FAMILIES) == set(CLEAR_GAINS) == set(LOADED_CLASSES)
    assert set(SHIPPED) <= set(zoo.FAMILIES) and set(UNSHIPPED) == {"open_clip", "open_clip-deep"}
    assert zoo.FAMILIES["llava"].requires == ("clip-vision", "llama-small")
    assert zoo.FAMILIES["llava-large"].requires == ("clip-vision", "llama-large")


def test_depths_and_widths_for_the_block_rules() -> None:
    """Causal LMs split evenly into 2, 4 and 8 blocks; FedMosaic's small and large Llamas differ in depth
    and width; FLAVA fuses with two multimodal layers."""
    models = {name: zoo.recipe(name)["model"] for name in ("llama-small", "llama-large", "qwen")}
    assert all(model["num_hidden_layers"] % 8 == 0 for model in models.values())
    small, large = models["llama-small"], models["llama-large"]
    assert small["num_hidden_layers"] < large["num_hidden_layers"] and small["hidden_size"] < large["hidden_size"]
    assert len({model["hidden_size"] for model in models.values()}) == 3
    assert zoo.recipe("flava")["model"]["multimodal_layers"] >= 2


def test_shipped_folders_match_the_current_recipes() -> None:
    """A recipe change without re-shipping (``rayfed.zoo.cache.ship(family)``) fails here."""
    assert sorted(family for family in zoo.FAMILIES if zoo.shipped(family)) == sorted(SHIPPED), (
        "a shipped family's recipe changed: rebuild and re-ship it with rayfed.zoo.cache.ship(family)"
    )
    folders = sorted(path for path in cache.PACKAGED.iterdir())
    assert [folder.name for folder in folders] == sorted(f"{family}-{zoo.recipe_hash(family)}" for family in SHIPPED)
    total = 0
    for folder in folders:
        manifest = zoo.read_manifest(folder)
        family = manifest["family"]
        assert manifest["recipe_hash"] == zoo.recipe_hash(family) and manifest["recipe"] == zoo.recipe(family)
        assert manifest["requires"] == {dep: f"{dep}-{zoo.recipe_hash(dep)}" for dep in zoo.FAMILIES[family].requires}
        for weights in folder.glob("*.safetensors"):
            assert set(cache.safetensors_dtypes(weights).values()) <= {torch.float16, torch.int64}, weights
        for saved in folder.glob("*.json"):
            assert '"/' not in saved.read_text(), f"{saved} names an absolute path of the machine that built it"
        total += sum(path.stat().st_size for path in folder.iterdir())
    assert total < SHIPPED_BYTES_LIMIT, total


def test_every_shipped_file_is_package_data() -> None:
    """pyproject's package-data glob (``weights/*/*``) covers every file of every shipped folder."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    (globs,) = re.findall(r'"rayfed\.zoo" = \[([^\]]*)\]', pyproject)
    patterns = re.findall(r'"([^"]+)"', globs)
    packaged = {path for pattern in patterns for path in cache.PACKAGED.parent.glob(pattern) if path.is_file()}
    assert packaged == {path for path in cache.PACKAGED.rglob("*") if path.is_file()}
    for family in SHIPPED:
        names = {path.name for path in (cache.PACKAGED / f"{family}-{zoo.recipe_hash(family)}").iterdir()}
        assert {"manifest.json", "config.json", "model.safetensors"} <= names, (family, names)
        if family not in ("vit", "clip-vision") and not family.startswith("vit-ladder"):
            assert "tokenizer.json" in names, (family, names)


@pytest.mark.parametrize("family", SHIPPED)
def test_shipped_model_loads_as_float32_without_a_build_and_passes_its_gate(no_builds: Path, family: str) -> None:
    """The shipped folder loads through its real loader and scores what its manifest says (the gate)."""
    folder = zoo.pretrained(family)
    assert folder.parent == cache.PACKAGED
    manifest = zoo.read_manifest(folder)
    assert_clear_gain(family, manifest["metrics"])
    assert manifest["family"] == family and manifest["params"] > 0 and manifest["build_seconds"] > 0
    loaded = zoo.load(f"tiny-pretrained:{family}")
    assert type(loaded.model) is LOADED_CLASSES[family] and float_dtypes(loaded.model) == {torch.float32}
    assert zoo.load(f"hf:{folder}").model.state_dict().keys() == loaded.model.state_dict().keys()
    assert zoo.evaluate(family, folder) == pytest.approx(manifest["metrics"]["after"])


@pytest.mark.parametrize("family", REBUILDS)
def test_one_rebuild_per_family_kind_is_deterministic(
    fresh_cache: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """A reduced recipe builds into the cache through the family's build code (LLaVA's from the shipped
    vision tower and Llama), bit-identically twice, loads through the real loader and beats its random
    initialization; the build leaves the caller's RNG and threads alone."""
    overrides = REBUILDS[family]
    assert zoo.recipe_hash(family, overrides) != zoo.recipe_hash(family)
    rng_state, threads = torch.get_rng_state(), torch.get_num_threads()
    folder = zoo.pretrained(family, overrides)
    assert torch.equal(torch.get_rng_state(), rng_state) and torch.get_num_threads() == threads
    assert folder == fresh_cache / "pretrained" / f"{family}-{zoo.recipe_hash(family, overrides)}"
    assert [path.name for path in folder.parent.iterdir() if path.is_dir()] == [folder.name]  # no dependency built
    manifest = zoo.read_manifest(folder)
    assert manifest["recipe"] == zoo.recipe(family, overrides)
    (metric, *_), *_ = CLEAR_GAINS[family]
    before, after = manifest["metrics"]["before"][metric], manifest["metrics"]["after"][metric]
    assert (after < before / 2) if metric in LOWER_IS_BETTER else (after > before + 0.05), (metric, before, after)

    loaded = zoo.FAMILIES[family].load(str(folder))
    assert type(loaded.model) is LOADED_CLASSES[family] and float_dtypes(loaded.model) == {torch.float32}
    assert zoo.evaluate(family, folder) == pytest.approx(manifest["metrics"]["after"])

    monkeypatch.setenv("RAYFED_CACHE", str(tmp_path_factory.mktemp("second-cache")))
    again = zoo.pretrained(family, overrides)
    assert again != folder
    files = sorted(path.name for path in folder.glob("*.safetensors"))
    assert files and files == sorted(path.name for path in again.glob("*.safetensors"))
    for name in files:
        weights = [safetensors.torch.load_file(f / name) for f in (folder, again)]
        assert weights[0].keys() == weights[1].keys()
        assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
        if family != "open_clip":  # open_clip's folder stays float32 (it does not ship)
            assert {tensor.dtype for tensor in weights[0].values() if tensor.is_floating_point()} == {torch.float16}


@pytest.mark.skipif(not FULL_BUILDS, reason="full default builds of unshipped families: RAYFED_TEST_FULL_BUILDS=1")
@pytest.mark.parametrize("family", UNSHIPPED)
def test_unshipped_family_builds_and_clearly_beats_its_random_initialization(fresh_cache: Path, family: str) -> None:
    folder = zoo.pretrained(family)
    manifest = zoo.read_manifest(folder)
    assert_clear_gain(family, manifest["metrics"])
    assert manifest["recipe_hash"] == zoo.recipe_hash(family) and manifest["build_seconds"] > 0
    loaded = zoo.load(f"tiny-pretrained:{family}")
    assert type(loaded.model) is LOADED_CLASSES[family] and float_dtypes(loaded.model) == {torch.float32}
    assert zoo.evaluate(family, folder) == pytest.approx(manifest["metrics"]["after"])


def test_second_use_reads_the_cache(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = zoo.pretrained("vit", QUICK_VIT)
    monkeypatch.setattr(cache, "_build", lambda *args: pytest.fail("rebuilt a cached model"))
    assert zoo.pretrained("vit", QUICK_VIT) == folder
    assert {family: zoo.pretrained(family) for family in SHIPPED} == {
        family: cache.PACKAGED / f"{family}-{zoo.recipe_hash(family)}" for family in SHIPPED
    }


def test_the_cache_takes_precedence_over_a_shipped_folder(fresh_cache: Path) -> None:
    """A folder built into the cache for a shipped recipe (e.g. by ``cache.ship``'s maintainer) is used first."""
    name = f"vit-{zoo.recipe_hash('vit')}"
    folder = fresh_cache / "pretrained" / name
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text((cache.PACKAGED / name / "manifest.json").read_text())
    assert zoo.pretrained("vit") == folder


def test_backbones_for_rayfed_models(no_builds: Path) -> None:
    for name, feature_dim in (("tiny-pretrained:vit", 64), ("tiny-pretrained:clip-vision", 64)):
        backbone = build_backbone(ModelConfig(backbone=name), seed=0)
        assert backbone.feature_dim == feature_dim and backbone.image_size == 32
        assert not any(p.requires_grad for p in backbone.encoder.parameters())
        assert float_dtypes(backbone.encoder) == {torch.float32}, name
    with pytest.raises(ConfigError, match="image_size"):
        build_backbone(ModelConfig(backbone="tiny-pretrained:vit", image_size=16), seed=0)


def test_tokenizer_round_trip_and_vocabulary(tmp_path: Path) -> None:
    tokenizer = word_tokenizer(append_eos=True)
    tokenizer.save_pretrained(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = [text for task in mm.TASKS for text in mm.generate(task, 40, seed=0, image_size=8)["text"]]
    texts += [
        t
        for task in ("vqa", "description", "multiple-choice")
        for t in mm.generate(task, 40, seed=0, image_size=8)["target"]
    ]
    encoded = reloaded(texts)["input_ids"]
    assert encoded == tokenizer(texts)["input_ids"] == load_tokenizer(str(tmp_path))(texts)["input_ids"]
    assert not any(tokenizer.unk_token_id in ids for ids in encoded)
    assert encoded[0][0] == tokenizer.bos_token_id and encoded[0][-1] == tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<image>") == 5 and len(tokenizer("<image><image> a")["input_ids"]) == 5


@pytest.mark.parametrize("family", [f for f in SHIPPED if f not in ("vit", "clip-vision") and "ladder" not in f])
def test_saved_tokenizers_neither_pad_nor_truncate(no_builds: Path, family: str) -> None:
    tokenizer = load_tokenizer(str(zoo.pretrained(family)))
    long_ids, short_ids = tokenizer([" ".join(["red"] * 80), "red"])["input_ids"]
    assert len(long_ids) > 80 and tokenizer.pad_token_id not in short_ids


@pytest.mark.parametrize("family", ["llava", "llava-large"])
def test_llava_processor_writes_the_training_sequences(no_builds: Path, family: str) -> None:
    loaded = zoo.load(f"tiny-pretrained:{family}")
    image = mm.shape_columns(1, seed=0)["image"][0]
    caption = "a photo of a red circle."
    inputs = loaded.processor(images=[image], text=[f"<image> {caption} <eos>"], return_tensors="pt")
    ids, mask, _ = llava.captioning_sequences(loaded.tokenizer, loaded.model.config, [caption])
    assert torch.equal(inputs["input_ids"][0], ids[0][mask[0].bool()])
    assert torch.allclose(inputs["pixel_values"], torch.from_numpy(image).permute(2, 0, 1)[None] / 127.5 - 1, atol=1e-5)
    text_config, language_model = loaded.model.config.text_config, zoo.recipe(zoo.FAMILIES[family].requires[1])["model"]
    assert (text_config.num_hidden_layers, text_config.hidden_size) == (
        language_model["num_hidden_layers"], language_model["hidden_size"]
    )


def test_changed_recipe_changes_the_hash() -> None:
    assert zoo.recipe_hash("vit", QUICK_VIT) != zoo.recipe_hash("vit")
    assert zoo.recipe_hash("llava") != zoo.recipe_hash("llava", {"train": {"lr": 1e-4}})
    assert zoo.recipe_hash("llava") != zoo.recipe_hash("llava-large")


def test_ship_copies_a_build_and_replaces_the_older_recipe(
    fresh_cache: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged = tmp_path_factory.mktemp("weights")
    monkeypatch.setattr(cache, "PACKAGED", packaged)
    (packaged / "vit-000000000000").mkdir()  # an older recipe's folder
    (packaged / "vit-ladder-t-000000000000").mkdir()  # another family's
    monkeypatch.setattr(cache, "recipe", lambda name, overrides=None: zoo.recipe(name, QUICK_VIT))  # a quick build
    shipped = cache.ship("vit")
    assert shipped.parent == packaged and zoo.shipped("vit")
    assert sorted(path.name for path in packaged.iterdir()) == sorted([shipped.name, "vit-ladder-t-000000000000"])
    assert sorted(path.name for path in shipped.iterdir()) == sorted(
        path.name for path in (fresh_cache / "pretrained" / shipped.name).iterdir()
    )


def test_concurrent_users_build_once(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Callers that find no model wait on the file lock (one flock per caller, as across processes)."""
    builds = []

    def slow_build(name, full_recipe, digest, folder, dependencies) -> None:
        builds.append(name)
        time.sleep(0.5)
        folder.mkdir()
        (folder / "manifest.json").write_text(json.dumps({"metrics": {}}))

    monkeypatch.setattr(cache, "_build", slow_build)
    with ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(lambda _: zoo.pretrained("vit", QUICK_VIT), range(3)))
    assert builds == ["vit"] and len(set(folders)) == 1


def test_unknown_family_and_recipe_key_are_one_clear_sentence(fresh_cache: Path) -> None:
    with pytest.raises(ConfigError, match=r"family = 'clipp' is not known \(did you mean 'clip'\?\); allowed: "):
        zoo.pretrained("clipp")
    with pytest.raises(ConfigError, match=r"vit recipe.train has no key 'step' \(did you mean 'steps'\?\)"):
        zoo.pretrained("vit", {"train": {"step": 3}})
    with pytest.raises(ConfigError, match="not known"):
        zoo.load("tiny:llava")
    with pytest.raises(ConfigError, match="only applies to open_clip"):
        zoo.load("tiny-pretrained:vit", pretrained="openai")
    with pytest.raises(ConfigError, match="could not be loaded"):
        zoo.load(f"hf:{fresh_cache / 'missing'}")


def test_unreadable_cache_file_is_reported(fresh_cache: Path) -> None:
    folder = fresh_cache / "pretrained" / f"vit-{zoo.recipe_hash('vit', QUICK_VIT)}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"cache file {folder / 'manifest.json'} is unreadable .*delete {folder}"):
        zoo.pretrained("vit", QUICK_VIT)


def test_cli_pretrain(no_builds: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["pretrain", "vit"]) == 0
    out = capsys.readouterr().out
    assert str(zoo.pretrained("vit")) in out and "accuracy" in out and "->" in out
    assert main(["pretrain", "vitt"]) == 2
    assert "did you mean 'vit'" in capsys.readouterr().err
