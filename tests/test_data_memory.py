"""Host memory of loaded data: images kept as uint8 (float per batch, bitwise as before), samples of several images,
subsets taken before decoding, one frame per video, the backbone's resize and crop, and the memory estimate."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import load_data
from rayfed.data.sources import ArrayDataset, DataError
from rayfed.errors import ConfigError
from rayfed.tasks.kinds import Classification, Reconstruction, image_tensor

datasets = pytest.importorskip("datasets")
Image = pytest.importorskip("PIL.Image")

NO_TEXT = SimpleNamespace(modalities=frozenset({"image"}))  # a backbone is read only for text


def _save(folder: Path, columns: dict, features: dict | None = None) -> str:
    dataset = datasets.Dataset.from_dict(columns, features=None if features is None else datasets.Features(features))
    dataset.save_to_disk(str(folder))
    return str(folder)


# uint8 images ---------------------------------------------------------------------------------------------------
def test_uint8_pixels_become_the_float32_that_dividing_in_float64_gave_for_every_value() -> None:
    values = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1)
    as_before = torch.as_tensor((values / 255.0).astype(np.float32)).permute(0, 3, 1, 2)
    now = image_tensor(values)
    assert now.dtype == torch.float32 and now.shape == (1, 1, 16, 16)
    assert torch.equal(now.view(torch.int32), as_before.contiguous().view(torch.int32))


def test_hf_images_stay_uint8_and_encode_bitwise_as_the_float_images_did(tmp_path: Path) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, size=(5, 6, 4, 3), dtype=np.uint8)
    folder = _save(tmp_path / "d", {"image": [Image.fromarray(p) for p in pixels], "label": [0, 1, 0, 1, 1]})
    data = load_data("hf:" + folder)
    assert data.images.dtype == np.uint8 and np.array_equal(data.images, pixels) and data.image_counts is None
    encoded = Classification().encode(data, np.array([4, 0, 2]), NO_TEXT)
    floats = (pixels[[4, 0, 2]] / 255.0).astype(np.float32)
    assert torch.equal(encoded["pixel_values"], torch.as_tensor(floats).permute(0, 3, 1, 2))
    assert "image_counts" not in encoded


def test_a_source_s_integer_pixels_are_kept_as_uint8_and_floats_as_they_were(tmp_path: Path) -> None:
    pixels = np.arange(2 * 3 * 2, dtype=np.int64).reshape(2, 3, 2) * 20
    data = load_data(lambda request: {"image": pixels, "label": [0, 1]})
    assert data.images.dtype == np.uint8 and data.images[..., 0].tolist() == pixels.tolist()
    floats = load_data(lambda request: {"image": pixels / 255.0, "label": [0, 1]})
    assert floats.images.dtype == np.float32 and np.array_equal(floats.images[..., 0], (pixels / 255.0).astype(np.float32))
    with pytest.raises(DataError, match="outside"):
        load_data(lambda request: {"image": pixels + 100, "label": [0, 1]})


def test_decoding_a_split_holds_no_float_copy_of_it(tmp_path: Path) -> None:
    """Images are decoded one by one into one uint8 array: the peak is far below the float32 array (4 bytes a pixel)
    that decoding used to build (from a float64 one, 8 bytes a pixel)."""
    pixels = np.random.default_rng(1).integers(0, 256, size=(400, 32, 32, 3), dtype=np.uint8)
    folder = _save(tmp_path / "d", {"image": [Image.fromarray(p) for p in pixels], "label": [0, 1] * 200})
    load_data("hf:" + folder)  # imports and caches outside the measurement
    tracemalloc.start()
    try:
        data = load_data("hf:" + folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(data.images, pixels)
    assert peak < 3 * pixels.nbytes < pixels.size * 4, (peak, pixels.nbytes)  # (about 1.8x: the array, raw files)


# samples of several images --------------------------------------------------------------------------------------
@pytest.fixture()
def several_images(tmp_path: Path) -> tuple[str, list[np.ndarray]]:
    """Four samples of 2, 0, 3 and 1 images (4x5 RGB; the second sample has none)."""
    rng = np.random.default_rng(2)
    samples = [rng.integers(0, 256, size=(count, 4, 5, 3), dtype=np.uint8) for count in (2, 0, 3, 1)]
    folder = _save(tmp_path / "multi", {"images": [[Image.fromarray(p) for p in sample] for sample in samples],
                                        "label": [0, 1, 2, 0]},
                   {"images": datasets.List(datasets.Image()), "label": datasets.Value("int64")})
    return folder, samples


def test_a_column_of_image_lists_gives_samples_of_several_images(several_images) -> None:
    folder, samples = several_images
    data = load_data("hf:" + folder, image_column="images")
    assert data.images.shape == (4, 3, 4, 5, 3) and data.images.dtype == np.uint8
    assert data.image_counts.dtype == np.int64 and data.image_counts.tolist() == [2, 0, 3, 1]
    for row, sample in enumerate(samples):
        assert np.array_equal(data.images[row, :len(sample)], sample)
        assert not data.images[row, len(sample):].any()
    picked = data.subset(np.array([2, 0]))
    assert picked.image_counts.tolist() == [3, 2] and np.array_equal(picked.images[1, :2], samples[0])
    encoded = Classification().encode(data, np.array([3, 2]), NO_TEXT)
    assert encoded["pixel_values"].shape == (2, 3, 3, 4, 5) and encoded["pixel_values"].dtype == torch.float32
    assert encoded["image_counts"].dtype == torch.int64 and encoded["image_counts"].tolist() == [1, 3]
    expected = torch.as_tensor((samples[2] / 255.0).astype(np.float32)).permute(0, 3, 1, 2)
    assert torch.equal(encoded["pixel_values"][1], expected)
    with pytest.raises(ConfigError, match=r"kind = 'reconstruction' rebuilds one image a sample.*up to 3 images"):
        Reconstruction().check_data(data, "data")


def test_several_images_a_sample_subsample_and_check_their_counts(several_images) -> None:
    folder, _ = several_images
    data = load_data("hf:" + folder, image_column="images", max_samples=2, seed=5)
    kept = data.image_counts.tolist()
    assert len(data) == 2 and set(kept) < {2, 0, 3, 1} and data.images.shape == (2, max(kept), 4, 5, 3)
    with pytest.raises(ValueError, match=r"\(N, K, H, W, C\) with image_counts"):
        ArrayDataset(images=np.zeros((2, 3, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match=r"image_counts must be int64 \(N,\) in 0\.\.3"):
        ArrayDataset(images=np.zeros((2, 3, 4, 4, 3), np.uint8), image_counts=np.array([1, 4]))
    with pytest.raises(ValueError, match="images must be uint8 or float32"):
        ArrayDataset(images=np.zeros((2, 4, 4, 3), np.float64))


# subsets before decoding ----------------------------------------------------------------------------------------
@pytest.fixture()
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the images whose pixels PIL decodes (an image's first load; its header alone is not counted)."""
    from PIL import ImageFile

    counted, load = [], ImageFile.ImageFile.load

    def counting_load(image):
        if image.tile:
            counted.append(1)
        return load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    return counted


def _pixels(count: int, size: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, size, size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def ten_thousand(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, np.ndarray]:
    """10,000 8x8 PNG images with 10 labels (written in about a second)."""
    pixels = _pixels(10_000)
    folder = tmp_path_factory.mktemp("hf") / "ten_thousand"
    return _save(folder, {"image": [Image.fromarray(p) for p in pixels], "label": np.arange(10_000) % 10}), pixels


def test_max_samples_of_a_10000_image_miniature_decodes_at_most_100_images(ten_thousand, decodes) -> None:
    """The subset is the one drawn when every image was decoded first, so recorded runs keep their samples."""
    from rayfed.data.sources.loading import _PURPOSE_SUBSET

    folder, pixels = ten_thousand
    data = load_data("hf:" + folder, max_samples=100, seed=7)
    assert len(decodes) == 100
    rng = np.random.default_rng(np.random.SeedSequence([7, _PURPOSE_SUBSET]))
    drawn = np.sort(rng.choice(10_000, size=100, replace=False))
    assert np.array_equal(data.images, pixels[drawn]) and data.labels.tolist() == (drawn % 10).tolist()


def _federation(data: dict, model: dict | None = None):
    from rayfed.config import build_config, model_configs
    from rayfed.data.clients import build_federation

    run = {"data": data, "federation": {"clients_per_round": data.get("num_clients", 10)}}
    config = build_config({**run, **({"model": model} if model else {})})
    return build_federation(config.data, config.seed, model_configs(config))


def test_a_federation_decodes_only_the_samples_its_clients_and_shared_tests_hold(tmp_path: Path, decodes) -> None:
    """Shards of 6 training and 2 test samples for 4 clients, and a global test set of 5, out of 400 images: 37
    decoded, and every client and the shared set see the samples and order that decoding all of them gives."""
    pixels = _pixels(400, seed=3)
    folder = _save(tmp_path / "d", {"image": [Image.fromarray(p) for p in pixels], "label": np.arange(400) % 4})
    partition = {"name": "shards", "classes_per_client": 2, "samples_per_client": 6, "test_samples_per_client": 2,
                 "global_test_samples": 5}
    lazy = _federation({"source": "hf:" + folder, "num_clients": 4, "partition": partition})
    assert len(decodes) == 4 * 8 + 5 == len(lazy.holdings[0].dataset)
    everything = ArrayDataset(pixels, np.arange(400, dtype=np.int64) % 4, ("0", "1", "2", "3"))
    eager = _federation({"source": lambda request: everything, "num_clients": 4, "partition": partition})
    (cut,), (whole,) = lazy.holdings, eager.holdings
    for client in range(4):
        for ours, theirs in zip(cut.split_of(client), whole.split_of(client)):
            assert np.array_equal(cut.dataset.images[ours], whole.dataset.images[theirs])
            assert np.array_equal(cut.dataset.labels[ours], whole.dataset.labels[theirs])
    assert np.array_equal(cut.dataset.images[lazy.shared[0].indices], whole.dataset.images[eager.shared[0].indices])
    assert lazy.shared[0].holding is cut


def test_a_split_expression_reads_a_save_to_disk_dataset_dict(tmp_path: Path, decodes) -> None:
    pixels = _pixels(12, seed=4)
    parts = {"train": pixels[:8], "test": pixels[8:]}
    folder = tmp_path / "dict"
    datasets.DatasetDict({name: datasets.Dataset.from_dict({"image": [Image.fromarray(p) for p in part],
                                                             "label": [0, 1] * (len(part) // 2)})
                          for name, part in parts.items()}).save_to_disk(str(folder))
    data = load_data("hf:" + str(folder), split="train[:50%]+test[-2:]")
    assert np.array_equal(data.images, np.concatenate([pixels[:4], pixels[10:]])) and len(decodes) == 6
    with pytest.raises(DataError, match=r"data\.split = 'tarin\[:5\]' is not a split .*available: train, test"):
        load_data("hf:" + str(folder), split="tarin[:5]")


# one frame per video --------------------------------------------------------------------------------------------
@pytest.fixture()
def videos(tmp_path: Path) -> str:
    """Frames of 3 videos (5, 4 and 1 frames) in shuffled rows, as flwrlabs/ucf101 stores them; a frame's pixels
    are its video number times 10 plus its frame number."""
    rows = [(video, frame) for video, frames in enumerate((5, 4, 1)) for frame in range(frames)]
    rows = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    images = [Image.fromarray(np.full((4, 4, 3), 10 * video + frame, np.uint8)) for video, frame in rows]
    return _save(tmp_path / "ucf", {"image": images, "video_id": [f"v_{video}" for video, _ in rows],
                                    "clip_id": [0] * len(rows), "frame": [frame for _, frame in rows],
                                    "label": [video % 2 for video, _ in rows]})


def test_one_frame_per_video_is_chosen_before_decoding(videos: str, decodes) -> None:
    middle = load_data("hf:" + videos, one_per_group={"column": "video_id", "order_column": "frame"})
    assert sorted(middle.images[:, 0, 0, 0].tolist()) == [2, 12, 20] and len(decodes) == 3  # frame n // 2 of n
    first = load_data("hf:" + videos, one_per_group={"column": "video_id", "order_column": "frame", "pick": "first"})
    assert sorted(first.images[:, 0, 0, 0].tolist()) == [0, 10, 20]
    stored = datasets.load_from_disk(videos)
    first_rows = sorted({video: row for row, video in reversed(list(enumerate(stored["video_id"])))}.values())
    in_row_order = load_data("hf:" + videos, one_per_group={"column": "video_id", "pick": "first"})
    expected = [10 * int(stored["video_id"][row][2:]) + stored["frame"][row] for row in first_rows]
    assert in_row_order.images[:, 0, 0, 0].tolist() == expected  # each video's first row, in the dataset's order
    # a clip named by two columns together (the copy's clip_id alone repeats across videos)
    assert len(load_data("hf:" + videos, one_per_group={"column": "clip_id"})) == 1
    by_both = load_data("hf:" + videos, one_per_group={"column": ["clip_id", "video_id"], "order_column": "frame"})
    assert np.array_equal(by_both.images, middle.images)
    with pytest.raises(DataError, match=r"data\.one_per_group\.order_column = 'frames' is not a column .*did you mean "
                                        r"'frame'.*columns: image, video_id, clip_id, frame, label\.$"):
        load_data("hf:" + videos, one_per_group={"column": "video_id", "order_column": "frames"})
    with pytest.raises(DataError, match=r"data\.one_per_group = .* is set but data\.source = 'synthetic'; it only "
                                        r"applies to hf: sources"):
        load_data("synthetic", one_per_group={"column": "video_id"})


# the backbone's resize and crop ---------------------------------------------------------------------------------
@pytest.fixture()
def mixed_sizes(tmp_path: Path) -> tuple[str, list]:
    """Images of five shapes: RGB, grayscale and RGBA, wider and taller than they are high."""
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8))
              for shape in [(12, 20, 3), (31, 15, 3), (9, 9, 3), (13, 21), (17, 16, 4)]]
    return _save(tmp_path / "mixed", {"image": images, "label": [0, 1, 0, 1, 0]}), images


def test_mixed_sizes_without_resize_name_data_resize(mixed_sizes) -> None:
    with pytest.raises(DataError, match=r"holds images of different sizes \(e\.g\. \(12, 20, 3\) and \(31, 15, 3\)\); "
                                        r"set data\.resize to a size \(e\.g\. 224\) or to 'backbone'"):
        load_data("hf:" + mixed_sizes[0])


def test_resize_backbone_resizes_and_crops_as_the_backbone_s_processor_does(mixed_sizes, tmp_path: Path) -> None:
    """A CLIP processor whose shortest edge (10) and crop (8 x 6) differ, with bilinear filtering: every image comes
    out as the processor's own pixels (before its rescaling and normalization, which the client model does)."""
    transformers = pytest.importorskip("transformers")
    folder, images = mixed_sizes
    model = tmp_path / "processor"
    transformers.CLIPImageProcessor(size={"shortest_edge": 10}, crop_size={"height": 8, "width": 6},
                                    resample=2).save_pretrained(str(model))
    (holding,) = _federation({"source": "hf:" + folder, "resize": "backbone", "num_clients": 1},
                             {"backbone": f"hf:{model}"}).holdings
    processor = transformers.AutoImageProcessor.from_pretrained(str(model), backend="pil")
    theirs = np.stack([processor(image, do_rescale=False, do_normalize=False, return_tensors="np")["pixel_values"][0]
                       for image in images]).transpose(0, 2, 3, 1)
    assert holding.dataset.images.shape == (5, 8, 6, 3) and np.array_equal(holding.dataset.images, theirs)
    with pytest.raises(DataError, match=r"data\.resize = 'backbone' needs the run's model\.backbone"):
        load_data("hf:" + folder, resize="backbone")
    with pytest.raises(ConfigError, match=r"data\.resize = 'backbone' needs a backbone with a saved image processor .*"
                                          r"model\.backbone = 'tiny:vit'; set data\.resize to a size"):
        _federation({"source": "hf:" + folder, "resize": "backbone", "num_clients": 1}, {"backbone": "tiny:vit"})


def test_an_int_resize_stays_a_square_bicubic_resize(mixed_sizes) -> None:
    folder, images = mixed_sizes
    data = load_data("hf:" + folder, resize=7)
    square = [np.asarray(image.convert("RGB").resize((7, 7), Image.Resampling.BICUBIC)) for image in images]
    assert np.array_equal(data.images, np.stack(square))


def test_the_backbone_s_processing_is_read_from_its_saved_configs(tmp_path: Path) -> None:
    """open_clip's: its image size, shortest-edge resize and crop rounded as torchvision does, and its filter; a
    ViT processor's: a resize to its height and width; a processor that keeps aspect ratios without a crop (ViLT's
    shortest edge) is refused, since the images would keep different sizes."""
    transformers = pytest.importorskip("transformers")
    from rayfed.config import ModelConfig
    from rayfed.models.image_processing import ImagePreprocessing, image_preprocessing

    clip = image_preprocessing(ModelConfig(backbone="open_clip:ViT-B-16", pretrained="openai"))
    assert clip == ImagePreprocessing(224, (224, 224), Image.Resampling.BICUBIC, "round", "drop", "open_clip:ViT-B-16")
    transformers.ViTImageProcessor(size={"height": 12, "width": 16}).save_pretrained(str(tmp_path / "vit"))
    vit = image_preprocessing(ModelConfig(backbone=f"hf:{tmp_path / 'vit'}"))
    assert (vit.size, vit.crop, vit.resample) == ((12, 16), None, Image.Resampling.BILINEAR)
    assert np.asarray(vit.apply(Image.new("L", (40, 30)))).shape == (12, 16, 3)
    transformers.CLIPImageProcessor(size={"shortest_edge": 12}, do_center_crop=False).save_pretrained(
        str(tmp_path / "keeps"))
    with pytest.raises(ConfigError, match=r"resizes each image's shortest edge to 12 without a crop.*set data\.resize"):
        image_preprocessing(ModelConfig(backbone=f"hf:{tmp_path / 'keeps'}"))


def test_backbones_of_a_run_must_agree_on_the_processing_resize_backbone_follows(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from rayfed.config import DataConfig, ModelConfig
    from rayfed.data.clients import backbone_image_processing

    for name, size in (("a", 12), ("b", 12), ("c", 14)):
        transformers.ViTImageProcessor(size={"height": size, "width": size}).save_pretrained(str(tmp_path / name))
    data = [DataConfig(source="hf:x", resize="backbone")]
    same = backbone_image_processing(data, [ModelConfig(backbone=f"hf:{tmp_path / name}") for name in "ab"])
    assert same.size == (12, 12)
    with pytest.raises(DataError, match=r"the run's backbones .* resize and crop differently; set data\.resize to a size"):
        backbone_image_processing(data, [ModelConfig(backbone=f"hf:{tmp_path / name}") for name in "ac"])
    assert backbone_image_processing([DataConfig(source="hf:x", resize=12)], [ModelConfig(backbone="tiny:vit")]) is None
    with pytest.raises(ConfigError, match=r"data\.resize = 'backbon' is invalid: it must be a size > 0 .* or 'backbone'"):
        load_data("hf:x", resize="backbon")


# memory and disk, stated before decoding ------------------------------------------------------------------------
def test_memory_and_disk_are_stated_and_a_data_set_too_large_is_refused_before_decoding(
        ten_thousand, decodes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from rayfed.data.sources import memory

    folder, _ = ten_thousand
    files = sum(path.stat().st_size for path in Path(folder).glob("*.arrow"))
    with caplog.at_level("INFO", logger="rayfed.data"):
        load_data("hf:" + folder, max_samples=1000)
    (line,) = [record.getMessage() for record in caplog.records if record.name == "rayfed.data"]
    assert line.startswith(f"data.source = 'hf:{folder}': 1,000 images at 8x8x3 uint8 ≈ 0.2 MiB host memory; "
                           f"files ≈ {files / 2**20:.1f} MiB on disk")
    monkeypatch.setattr(memory, "available_memory", lambda: 150_000)  # below 1,000 x 192 bytes of pixels
    decodes.clear()
    with pytest.raises(DataError, match=r"^The data needs ≈ 0\.2 MiB of host memory once its images are decoded, but "
                                        r"this machine has 0\.1 MiB available; lower data\.max_samples, take a slice of "
                                        r"data\.split \(e\.g\. 'train\[:10%\]'\) or set a smaller data\.resize\.$"):
        load_data("hf:" + folder, max_samples=1000)
    assert not decodes
    assert len(load_data("hf:" + folder, max_samples=500)) == 500  # 96,000 bytes of pixels fit


def test_rayfed_data_states_the_memory_and_disk_of_the_data(ten_thousand, tmp_path: Path, capsys) -> None:
    import yaml

    from rayfed.cli import main

    folder, _ = ten_thousand
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"name": "memory", "data": {"source": "hf:" + folder, "max_samples": 200,
                                                                  "num_clients": 2},
                                      "federation": {"clients_per_round": 2}}))
    assert main(["data", str(config), "--out", str(tmp_path)]) == 0
    assert f"rayfed: data.source = 'hf:{folder}': 200 images at 8x8x3 uint8 ≈ " in capsys.readouterr().err
