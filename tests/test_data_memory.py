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
    assert len(data) == 2 and len(data.image_counts) == 2 and data.images.shape[1] == 3
    with pytest.raises(ValueError, match=r"\(N, K, H, W, C\) with image_counts"):
        ArrayDataset(images=np.zeros((2, 3, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match=r"image_counts must be int64 \(N,\) in 0\.\.3"):
        ArrayDataset(images=np.zeros((2, 3, 4, 4, 3), np.uint8), image_counts=np.array([1, 4]))
    with pytest.raises(ValueError, match="images must be uint8 or float32"):
        ArrayDataset(images=np.zeros((2, 4, 4, 3), np.float64))
