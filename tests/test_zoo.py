"""rayfed.zoo: tiny pretrained models of every family, built once per session into the cache.

CI sets RAYFED_CACHE to a fresh folder; without it the session builds into a temporary folder, so the
build path itself is always exercised.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
    "flava": [("mmm_acc", 0.08, 0.05), ("itm_acc", 0.7, 0.6), ("zeroshot_acc", 0.15, 0.05)],
    "llama-small": [("perplexity", 4.0, 100.0)],
    "llama-large": [("perplexity", 4.0, 100.0)],
    "qwen": [("perplexity", 4.0, 100.0)],
    "llava": [("attribute_acc", 0.5, 0.1), ("caption_perplexity", 2.0, 100.0)],
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
    **{f"vit-ladder-{size}": transformers.ViTModel for size in "tsb"},
}
# Families the session builds or finds shipped: GPU-scale families rayfed does not ship are left out.
AVAILABLE = zoo.default_families()
# A recipe small enough to build in seconds, for the tests of the cache machinery.
QUICK_VIT = {"train": {"steps": 3, "batch_size": 8}, "data": {"train_samples": 64, "eval_samples": 64}}


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's pretrained folder, built once for the session, two families at a time."""
    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get("RAYFED_CACHE"):
            patch.setenv("RAYFED_CACHE", str(tmp_path_factory.mktemp("rayfed-cache")))
        yield dict(zoo.build_all(processes=2))


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAYFED_CACHE", str(tmp_path))
    return tmp_path


def test_families_cover_every_model_the_methods_use() -> None:
    assert set(zoo.FAMILIES) == set(CLEAR_GAINS) == set(LOADED_CLASSES)


@pytest.mark.parametrize("family", [family for family in CLEAR_GAINS if family in AVAILABLE])
def test_pretrained_model_clearly_beats_its_random_initialization(built: dict[str, Path], family: str) -> None:
    manifest = zoo.read_manifest(built[family])
    before, after = manifest["metrics"]["before"], manifest["metrics"]["after"]
    for metric, good, bad in CLEAR_GAINS[family]:
        if metric in LOWER_IS_BETTER:
            assert after[metric] <= good and before[metric] >= bad, (metric, before[metric], after[metric])
        else:
            assert after[metric] >= good and before[metric] <= bad, (metric, before[metric], after[metric])
    assert manifest["family"] == family and manifest["recipe_hash"] == zoo.recipe_hash(family)
    assert manifest["params"] > 0 and manifest["build_seconds"] > 0


@pytest.mark.parametrize("family", [family for family in LOADED_CLASSES if family in AVAILABLE])
def test_cached_model_reloads_through_its_real_loader(built: dict[str, Path], family: str) -> None:
    """The folder loads with from_pretrained / open_clip's local-dir loader and scores what the build measured."""
    loaded = zoo.load(f"tiny-pretrained:{family}")
    assert type(loaded.model) is LOADED_CLASSES[family]
    if not family.startswith("open_clip"):
        assert zoo.load(f"hf:{built[family]}").model.state_dict().keys() == loaded.model.state_dict().keys()
    assert zoo.evaluate(family, built[family]) == pytest.approx(zoo.read_manifest(built[family])["metrics"]["after"])


def test_second_use_reads_the_cache(built: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "_build", lambda *args: pytest.fail("rebuilt a cached model"))
    assert {family: zoo.pretrained(family) for family in AVAILABLE} == built


def test_backbones_for_rayfed_models(built: dict[str, Path]) -> None:
    for name, feature_dim in (("tiny-pretrained:vit", 64), ("tiny-pretrained:clip-vision", 64)):
        backbone = build_backbone(ModelConfig(backbone=name), seed=0)
        assert backbone.feature_dim == feature_dim and backbone.image_size == 32
        assert not any(p.requires_grad for p in backbone.encoder.parameters())
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


@pytest.mark.parametrize("family", ["clip", "vilt", "flava", "llama-small", "qwen", "llava"])
def test_saved_tokenizers_neither_pad_nor_truncate(built: dict[str, Path], family: str) -> None:
    tokenizer = load_tokenizer(str(built[family]))
    long_ids, short_ids = tokenizer([" ".join(["red"] * 80), "red"])["input_ids"]
    assert len(long_ids) > 80 and tokenizer.pad_token_id not in short_ids


def test_llava_processor_writes_the_training_sequences(built: dict[str, Path]) -> None:
    loaded = zoo.load("tiny-pretrained:llava")
    image = mm.shape_columns(1, seed=0)["image"][0]
    caption = "a photo of a red circle."
    inputs = loaded.processor(images=[image], text=[f"<image> {caption} <eos>"], return_tensors="pt")
    ids, mask, _ = llava.captioning_sequences(loaded.tokenizer, loaded.model.config, [caption])
    assert torch.equal(inputs["input_ids"][0], ids[0][mask[0].bool()])
    assert torch.allclose(inputs["pixel_values"], torch.from_numpy(image).permute(2, 0, 1)[None] / 127.5 - 1, atol=1e-5)


def test_changed_recipe_builds_a_new_deterministic_entry(
    fresh_cache: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch
) -> None:
    assert zoo.recipe_hash("vit", QUICK_VIT) != zoo.recipe_hash("vit")
    assert zoo.recipe_hash("llava") != zoo.recipe_hash("llava", {"train": {"lr": 1e-4}})
    rng_state, threads = torch.get_rng_state(), torch.get_num_threads()
    folder = zoo.pretrained("vit", QUICK_VIT)
    assert folder.name == f"vit-{zoo.recipe_hash('vit', QUICK_VIT)}" and folder.parent == fresh_cache / "pretrained"
    assert torch.equal(torch.get_rng_state(), rng_state) and torch.get_num_threads() == threads
    assert zoo.read_manifest(folder)["recipe"]["train"]["steps"] == 3

    monkeypatch.setenv("RAYFED_CACHE", str(tmp_path_factory.mktemp("second-cache")))
    again = zoo.pretrained("vit", QUICK_VIT)
    assert again != folder
    weights = [safetensors.torch.load_file(f / "model.safetensors") for f in (folder, again)]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])


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


def test_cli_pretrain(built: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert main(["pretrain", "vit"]) == 0
    out = capsys.readouterr().out
    assert str(built["vit"]) in out and "accuracy" in out and "->" in out
    assert main(["pretrain", "vitt"]) == 2
    assert "did you mean 'vit'" in capsys.readouterr().err
