"""rayfed.data: sources (digits, Fashion-MNIST IDX, HF datasets, synthetic) and partitioners."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import load_data
from rayfed import registry
from rayfed.data import ArrayDataset, DataError, partition, split_train_test
from rayfed.data.sources import FASHION_MNIST_CLASSES, FASHION_MNIST_DEFAULT_DIR
from rayfed.errors import ConfigError


@pytest.fixture(scope="module")
def digits() -> ArrayDataset:
    return load_data("sklearn:digits")


def label_histograms(labels: np.ndarray, clients: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Row i: client i's label distribution."""
    counts = np.stack([np.bincount(labels[idx], minlength=num_classes) for idx in clients])
    return counts / counts.sum(axis=1, keepdims=True)


def mean_distance_to_global(labels: np.ndarray, clients: list[np.ndarray], num_classes: int) -> float:
    """Average total-variation distance between each client's label distribution and the global one."""
    global_dist = np.bincount(labels, minlength=num_classes) / len(labels)
    return float(np.mean(0.5 * np.abs(label_histograms(labels, clients, num_classes) - global_dist).sum(axis=1)))


# ---------------------------------------------------------------------------------------------
# Sources


def test_registry_names() -> None:
    data_sources = ["sklearn:digits", "fashion_mnist", "hf:<...>", "synthetic", "shapes", "multimodal:<...>",
                    "task-groups:<...>"]
    # methods may register sources of their own (tap:, parts: test_ladder.py), before or after the data package's
    assert [name for name in registry.names("source") if name in data_sources] == data_sources
    # a paper's package registers its own after the data package's (pFedMMA's base_novel)
    assert registry.names("partitioner") == ["iid", "dirichlet", "shards", "natural", "labeldir", "domain_dirichlet",
                                             "base_novel"]
    assert issubclass(DataError, ConfigError) and issubclass(DataError, ValueError)


def test_digits_shapes_and_range(digits: ArrayDataset) -> None:
    assert digits.images.shape == (1797, 8, 8, 1)
    assert digits.images.dtype == np.float32 and digits.labels.dtype == np.int64
    assert digits.images.min() == 0.0 and digits.images.max() == 1.0
    assert digits.class_names == tuple("0123456789") and digits.num_classes == 10
    assert set(np.unique(digits.labels)) == set(range(10))
    assert digits.groups is None


def test_unknown_source_suggests_close_match() -> None:
    with pytest.raises(ConfigError, match=r"data\.source = 'sklearn:digit' .*did you mean 'sklearn:digits'\?"):
        load_data("sklearn:digit")


def test_max_samples_is_a_seeded_subset(digits: ArrayDataset) -> None:
    first = load_data("sklearn:digits", max_samples=100, seed=3)
    again = load_data("sklearn:digits", max_samples=100, seed=3)
    other = load_data("sklearn:digits", max_samples=100, seed=4)
    assert len(first) == 100
    np.testing.assert_array_equal(first.images, again.images)
    assert not np.array_equal(first.labels, other.labels)
    # every kept sample is a real sample of the full set
    flat = digits.images.reshape(len(digits), -1)
    assert all((flat == image.reshape(-1)).all(axis=1).any() for image in first.images[:10])
    with pytest.raises(ConfigError, match=r"data\.max_samples = 0"):
        load_data("sklearn:digits", max_samples=0)


def test_split_rejected_for_single_split_sources() -> None:
    with pytest.raises(DataError, match=r"data\.split = 'train'"):
        load_data("sklearn:digits", split="train")


def test_synthetic_is_deterministic_by_seed() -> None:
    first = load_data("synthetic", seed=1)
    again = load_data("synthetic", seed=1)
    other = load_data("synthetic", seed=2)
    np.testing.assert_array_equal(first.images, again.images)
    np.testing.assert_array_equal(first.labels, again.labels)
    np.testing.assert_array_equal(first.groups, again.groups)
    assert not np.array_equal(first.images, other.images)
    assert first.images.shape == (600, 8, 8, 1) and first.num_classes == 10
    assert 0.0 <= first.images.min() and first.images.max() <= 1.0
    assert len(np.unique(first.groups)) == 30


def test_synthetic_options_and_learnable_classes() -> None:
    data = load_data(
        "synthetic", synthetic={"num_samples": 90, "num_classes": 3, "image_size": 4, "channels": 3, "noise": 0.05}
    )
    assert data.images.shape == (90, 4, 4, 3) and np.bincount(data.labels).tolist() == [30, 30, 30]
    # with little noise, every sample is nearest to its own class mean
    means = np.stack([data.images[data.labels == k].mean(axis=0) for k in range(3)])
    distances = ((data.images[:, None] - means[None]) ** 2).sum(axis=(2, 3, 4))
    assert (distances.argmin(axis=1) == data.labels).all()
    with pytest.raises(DataError, match=r"data\.options\.num_samples = 0"):
        load_data("synthetic", synthetic={"num_samples": 0})
    with pytest.raises(DataError, match=r"data\.options has no option 'num_sample' \(did you mean 'num_samples'"):
        load_data("synthetic", synthetic={"num_sample": 10})
    with pytest.raises(DataError, match=r"data\.options is set but data\.source = 'sklearn:digits' takes no options"):
        load_data("sklearn:digits", synthetic={"num_samples": 10})


def test_synthetic_text_prompts_of_exact_length_whose_target_copies_their_first_words() -> None:
    data = load_data("synthetic-text", seed=1, synthetic={"num_samples": 5, "prompt_words": 12, "target_words": 4})
    np.testing.assert_array_equal(data.text, load_data("synthetic-text", seed=1, synthetic={
        "num_samples": 5, "prompt_words": 12, "target_words": 4}).text)
    assert len(data) == 5 and data.labels is None and data.images is None
    for prompt, target in zip(data.text, data.target):
        assert len(prompt.split()) == 12 and target.split() == prompt.split()[:4]
    with pytest.raises(DataError, match=r"data\.options\.target_words = 13 is more than prompt_words = 12"):
        load_data("synthetic-text", synthetic={"prompt_words": 12, "target_words": 13})
    with pytest.raises(DataError, match=r"data\.options has no option 'seq_len' for 'synthetic-text'; allowed: "
                                        r"num_samples, prompt_words, target_words\."):
        load_data("synthetic-text", synthetic={"seq_len": 12})


def test_group_column_per_source() -> None:
    writers = load_data("synthetic", group_column="writer").groups
    np.testing.assert_array_equal(writers, load_data("synthetic").groups)
    with pytest.raises(DataError, match=r"data\.partition\.column = 'author' is not a column of 'synthetic'"):
        load_data("synthetic", group_column="author")
    with pytest.raises(DataError, match=r"data\.partition\.column = 'writer' cannot be used with source"):
        load_data("sklearn:digits", group_column="writer")


def test_hf_float_arrays_and_bad_pixels(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    unit = np.linspace(0, 1, 12, dtype=np.float32).reshape(2, 3, 2)
    folder = tmp_path / "floats"
    datasets.Dataset.from_dict({"image": unit.tolist(), "label": [7, 3]}).save_to_disk(str(folder))
    data = load_data("hf:" + str(folder))
    assert data.images.shape == (2, 3, 2, 1) and data.class_names == ("3", "7") and data.labels.tolist() == [1, 0]
    np.testing.assert_allclose(data.images[..., 0], unit, rtol=1e-6)
    bad = tmp_path / "bad"
    datasets.Dataset.from_dict({"image": (unit * 300).tolist(), "label": [0, 1]}).save_to_disk(str(bad))
    with pytest.raises(DataError, match=r"data\.image_column = 'image' has pixel values outside"):
        load_data("hf:" + str(bad))


def write_idx(file: Path, array: np.ndarray) -> None:
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(file, "wb") as stream:
        stream.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture()
def tiny_fashion_dir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    for prefix, count in (("train", 12), ("t10k", 5)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, size=(count, 28, 28)))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(count) % 10)
    return tmp_path


def test_fashion_mnist_from_idx_files(tiny_fashion_dir: Path) -> None:
    pooled = load_data("fashion_mnist", path=str(tiny_fashion_dir))
    train = load_data("fashion_mnist", path=str(tiny_fashion_dir), split="train")
    test = load_data("fashion_mnist", path=str(tiny_fashion_dir), split="test")
    assert pooled.images.shape == (17, 28, 28, 1) and len(train) == 12 and len(test) == 5
    assert pooled.class_names == FASHION_MNIST_CLASSES and pooled.num_classes == 10
    np.testing.assert_array_equal(pooled.labels, np.concatenate([np.arange(12) % 10, np.arange(5)]))
    with gzip.open(tiny_fashion_dir / "t10k-images-idx3-ubyte.gz") as stream:
        raw_first = np.frombuffer(stream.read()[16 : 16 + 784], np.uint8).reshape(28, 28)
    np.testing.assert_allclose(test.images[0, ..., 0], raw_first / 255.0, rtol=1e-6)
    assert pooled.images.dtype == np.float32 and pooled.images.max() <= 1.0
    with pytest.raises(DataError, match=r"data\.split = 'valid'"):
        load_data("fashion_mnist", path=str(tiny_fashion_dir), split="valid")


def test_fashion_mnist_missing_and_corrupt_files(tmp_path: Path, tiny_fashion_dir: Path) -> None:
    missing = tmp_path / "nothing-here"
    with pytest.raises(DataError, match=r"data\.path: '.*nothing-here' has no Fashion-MNIST IDX files"):
        load_data("fashion_mnist", path=str(missing))
    with gzip.open(tiny_fashion_dir / "train-labels-idx1-ubyte.gz", "wb") as stream:
        stream.write(b"not an idx file")
    with pytest.raises(DataError, match=r"data\.path: '.*train-labels-idx1-ubyte\.gz' is not an IDX file"):
        load_data("fashion_mnist", path=str(tiny_fashion_dir))


@pytest.mark.skipif(
    not Path(FASHION_MNIST_DEFAULT_DIR, "t10k-images-idx3-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_fashion_mnist_from_debian_location() -> None:
    test = load_data("fashion_mnist", split="test")
    assert test.images.shape == (10000, 28, 28, 1)
    assert np.bincount(test.labels).tolist() == [1000] * 10
    assert 0.0 <= test.images.min() and test.images.max() == 1.0


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(6, 5, 4, 3), dtype=np.uint8)
    features = datasets.Features(
        {
            "img": datasets.Image(),
            "target": datasets.ClassLabel(names=["cat", "dog", "eel"]),
            "writer": datasets.Value("string"),
        }
    )
    table = {
        "img": [Image.fromarray(p) for p in pixels],
        "target": [0, 1, 2, 0, 1, 2],
        "writer": ["w1", "w2", "w1", "w2", "w1", "w2"],
    }
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(folder))
    return folder, pixels


def test_hf_round_trip_from_save_to_disk(tiny_hf_dir: tuple[Path, np.ndarray]) -> None:
    folder, pixels = tiny_hf_dir
    data = load_data("hf:" + str(folder), image_column="img", label_column="target", group_column="writer")
    assert data.images.shape == (6, 5, 4, 3) and data.images.dtype == np.uint8
    np.testing.assert_array_equal(data.images, pixels)
    assert data.class_names == ("cat", "dog", "eel")
    assert data.labels.tolist() == [0, 1, 2, 0, 1, 2]
    assert data.groups.tolist() == ["w1", "w2", "w1", "w2", "w1", "w2"]
    via_path = load_data("hf:tiny", path=str(folder), image_column="img", label_column="target")
    np.testing.assert_array_equal(via_path.images, data.images)


def test_hf_missing_column_lists_columns(tiny_hf_dir: tuple[Path, np.ndarray]) -> None:
    folder, _ = tiny_hf_dir
    with pytest.raises(DataError, match=r"data\.image_column = 'image' .*columns: img, target, writer"):
        load_data("hf:" + str(folder), label_column="target")
    with pytest.raises(DataError, match=r"data\.label_column = 'label' .*columns: img, target, writer"):
        load_data("hf:" + str(folder), image_column="img")
    with pytest.raises(DataError, match=r"data\.partition\.column = 'author' .*columns: img, target, writer"):
        load_data("hf:" + str(folder), image_column="img", label_column="target", group_column="author")


def test_hf_dataset_dict_grayscale_and_plain_labels(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    def part(labels: list[str]) -> object:
        images = [Image.fromarray(np.full((3, 2), 51 * i, np.uint8), mode="L") for i in range(len(labels))]
        return datasets.Dataset.from_dict({"image": images, "label": labels}).cast_column("image", datasets.Image())

    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": part(["b", "a", "c"]), "test": part(["c", "b"])}).save_to_disk(str(folder))
    pooled = load_data("hf:" + str(folder))
    assert pooled.images.shape == (5, 3, 2, 1)
    assert pooled.class_names == ("a", "b", "c") and pooled.labels.tolist() == [1, 0, 2, 2, 1]
    assert pooled.images[:3, 0, 0, 0].tolist() == [0, 51, 102] and pooled.images.dtype == np.uint8
    test = load_data("hf:" + str(folder), split="test")
    assert test.class_names == ("b", "c") and test.labels.tolist() == [1, 0]
    with pytest.raises(DataError, match=r"data\.split = 'tset' .*did you mean 'test'.*available: train, test"):
        load_data("hf:" + str(folder), split="tset")


def test_hf_unloadable_dataset_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"^data\.source = 'hf:no-such/dataset-xyz' could not be loaded") as info:
        load_data("hf:no-such/dataset-xyz")
    assert info.value.__cause__ is not None
    with pytest.raises(DataError, match=r"data\.path = '.*absent' is not a folder"):
        load_data("hf:x", path=str(tmp_path / "absent"))


@pytest.fixture(scope="module")
def text_hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """save_to_disk folders with text columns, as hub VQA, topic and multiple-choice datasets have them."""
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    root = tmp_path_factory.mktemp("hf_text")
    images = [Image.fromarray(np.full((8, 8, 3), 30 * i, np.uint8)) for i in range(6)]
    vqa = {"image": images, "question": ["what color is it?"] * 3 + ["how many are there?"] * 3,
           "answer": ["red", "blue", "red", "two", "one", "two"], "qtype": ["color"] * 3 + ["count"] * 3}
    datasets.Dataset.from_dict(vqa).save_to_disk(str(root / "vqa"))
    mc = {"question": [f"which is {w}?" for w in "abcdef"], "options": [["x", "y", "z"]] * 6, "right": [0, 1, 2, 0, 1, 2]}
    datasets.Dataset.from_dict(mc).save_to_disk(str(root / "mc"))
    datasets.Dataset.from_dict({"text": ["a b", "c d"] * 3, "summary": ["ab", "cd"] * 3}).save_to_disk(str(root / "gen"))
    return {name: root / name for name in ("vqa", "mc", "gen")}


def test_hf_text_columns_by_name(text_hf_dirs: dict[str, Path]) -> None:
    vqa = load_data("hf:" + str(text_hf_dirs["vqa"]), text_column="question", label_column="answer",
                    target_column="answer", group_column="qtype")
    assert vqa.images.shape == (6, 8, 8, 3) and vqa.text[3] == "how many are there?"
    assert vqa.class_names == ("blue", "one", "red", "two") and vqa.labels.tolist() == [2, 0, 2, 3, 1, 3]
    assert vqa.target.tolist() == ["red", "blue", "red", "two", "one", "two"] and set(vqa.groups) == {"color", "count"}
    mc = load_data("hf:" + str(text_hf_dirs["mc"]), text_column="question", choices_column="options", label_column="right")
    assert mc.images is None and mc.choices.shape == (6, 3) and mc.labels.tolist() == [0, 1, 2, 0, 1, 2]
    gen = load_data("hf:" + str(text_hf_dirs["gen"]), text_column="text", target_column="summary")
    assert gen.labels is None and gen.target.tolist()[:2] == ["ab", "cd"]
    with pytest.raises(DataError, match=r"data\.text_column = 'prompt' is not a column of .*columns: text, summary"):
        load_data("hf:" + str(text_hf_dirs["gen"]), text_column="prompt", target_column="summary")
    with pytest.raises(DataError, match=r"data\.label_column = 'label' is not a column .*columns: text"):
        load_data("hf:" + str(text_hf_dirs["gen"]), text_column="text")


def test_multimodal_sources_and_their_heterogeneity_groups() -> None:
    vqa = load_data("multimodal:vqa", synthetic={"num_samples": 60}, group_column="question_type")
    assert vqa.images.shape == (60, 32, 32, 3) and vqa.labels.max() < 20 and vqa.domains == ("color", "count", "shape")
    assert all(q.startswith("what") or q.startswith("how") for q in vqa.text)
    scenes = load_data("multimodal:shapes", synthetic={"num_samples": 90, "scenes": 3, "scene_classes": 4},
                       group_column="scene")
    per_scene = [set(scenes.labels[scenes.groups == s]) for s in range(3)]
    assert all(len(classes) <= 4 for classes in per_scene) and len(set.union(*per_scene)) > 4  # own class priors
    assert scenes.text is None and scenes.target is not None  # captions are targets, never inputs of a class
    mc = load_data("multimodal:multiple-choice", synthetic={"num_samples": 20})
    assert mc.choices.shape == (20, 4) and all(row[label] in target for row, label, target in
                                               zip(mc.choices, mc.labels, mc.target))
    with pytest.raises(DataError, match=r"data\.source = 'multimodal:vqaa' names no generator \(did you mean"):
        load_data("multimodal:vqaa")
    with pytest.raises(DataError, match=r"data\.partition\.column = 'writer' is not a column of 'multimodal:vqa'"):
        load_data("multimodal:vqa", group_column="writer")


# ---------------------------------------------------------------------------------------------
# Partitioners


@pytest.mark.parametrize(
    ("method", "options"),
    [("iid", {}), ("dirichlet", {"alpha": 0.5}), ("shards", {"classes_per_client": 2, "samples_per_client": 40})],
)
def test_partition_deterministic_by_seed(digits: ArrayDataset, method: str, options: dict) -> None:
    first = partition(digits.labels, 8, method, seed=5, **options)
    again = partition(digits.labels, 8, method, seed=5, **options)
    other = partition(digits.labels, 8, method, seed=6, **options)
    assert len(first) == 8
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))
    for indices in first:
        assert indices.dtype == np.int64 and (np.diff(indices) > 0).all()


@pytest.mark.parametrize(("method", "options"), [("iid", {}), ("dirichlet", {"alpha": 0.3})])
def test_partition_is_disjoint_and_covering(digits: ArrayDataset, method: str, options: dict) -> None:
    clients = partition(digits.labels, 10, method, seed=0, **options)
    everything = np.concatenate(clients)
    assert len(everything) == len(digits) and len(np.unique(everything)) == len(digits)
    if method == "iid":
        sizes = [len(c) for c in clients]
        assert max(sizes) - min(sizes) <= 1


def test_dirichlet_small_alpha_skews_labels(digits: ArrayDataset) -> None:
    iid = partition(digits.labels, 10, "iid", seed=0)
    skewed = partition(digits.labels, 10, "dirichlet", seed=0, alpha=0.1)
    mild = partition(digits.labels, 10, "dirichlet", seed=0, alpha=100.0)
    iid_distance = mean_distance_to_global(digits.labels, iid, 10)
    skewed_distance = mean_distance_to_global(digits.labels, skewed, 10)
    assert iid_distance < 0.1
    assert skewed_distance > 0.5
    assert mean_distance_to_global(digits.labels, mild, 10) < 0.15
    # most clients miss some classes entirely
    assert np.mean([len(np.unique(digits.labels[c])) < 10 for c in skewed]) > 0.5


def test_dirichlet_errors(digits: ArrayDataset) -> None:
    with pytest.raises(DataError, match=r"data\.partition\.alpha = 0 is invalid: it must be > 0"):
        partition(digits.labels, 5, "dirichlet", seed=0, alpha=0)
    with pytest.raises(DataError, match=r"data\.partition\.alpha is required"):
        partition(digits.labels, 5, "dirichlet", seed=0)
    labels = np.repeat(np.arange(3), 4)
    with pytest.raises(DataError, match=r"client \d+ has .*larger data\.partition\.alpha or fewer data\.num_clients"):
        partition(labels, 6, "dirichlet", seed=0, alpha=0.01, min_samples=2)


def test_dirichlet_honours_min_samples() -> None:
    labels = np.repeat(np.arange(4), 25)
    clients = partition(labels, 10, "dirichlet", seed=1, alpha=0.5, min_samples=5)
    assert min(len(c) for c in clients) >= 5


def test_shards_exact_classes_and_samples(digits: ArrayDataset) -> None:
    clients = partition(digits.labels, 15, "shards", seed=0, classes_per_client=3, samples_per_client=31)
    held = [set(np.unique(digits.labels[c]).tolist()) for c in clients]
    assert all(len(classes) == 3 for classes in held)
    assert all(len(c) == 31 for c in clients)
    for c in clients:  # balanced over the client's classes: 11, 10, 10
        assert sorted(np.bincount(digits.labels[c])[np.bincount(digits.labels[c]) > 0].tolist()) == [10, 10, 11]
    holders = np.bincount([k for classes in held for k in classes], minlength=10)
    assert holders.min() >= 4 and holders.max() <= 5  # 15 * 3 / 10 = 4.5 clients per class
    assert len(np.unique(np.concatenate(clients))) == 15 * 31


def test_shards_without_subset_uses_whole_classes(digits: ArrayDataset) -> None:
    clients = partition(digits.labels, 5, "shards", seed=0, classes_per_client=2)
    assert sorted(np.concatenate(clients).tolist()) == list(range(len(digits)))
    assert all(len(np.unique(digits.labels[c])) == 2 for c in clients)


def test_shards_errors(digits: ArrayDataset) -> None:
    with pytest.raises(DataError, match=r"data\.partition\.classes_per_client = 11 is invalid"):
        partition(digits.labels, 5, "shards", seed=0, classes_per_client=11)
    with pytest.raises(DataError, match=r"data\.partition\.classes_per_client = 0 is invalid"):
        partition(digits.labels, 5, "shards", seed=0, classes_per_client=0)
    with pytest.raises(DataError, match=r"data\.partition\.classes_per_client is required"):
        partition(digits.labels, 5, "shards", seed=0)
    with pytest.raises(DataError, match=r"data\.partition\.samples_per_client = 1000 is too large: client \d+"):
        partition(digits.labels, 10, "shards", seed=0, classes_per_client=2, samples_per_client=1000)
    with pytest.raises(DataError, match=r"data\.partition: client \d+ has no samples of class"):
        partition(np.repeat(np.arange(2), 2), 6, "shards", seed=0, classes_per_client=1, min_samples=1)


def test_natural_one_client_per_group() -> None:
    data = load_data("synthetic", synthetic={"num_samples": 120, "num_writers": 12})
    clients = partition(data.labels, 12, "natural", seed=0, groups=data.groups)
    assert [np.unique(data.groups[c]).tolist() for c in clients] == [[g] for g in range(12)]
    assert len(np.concatenate(clients)) == 120
    first_five = partition(data.labels, 5, "natural", seed=0, groups=data.groups)
    for a, b in zip(first_five, clients[:5]):
        np.testing.assert_array_equal(a, b)
    names = np.array(["bob", "amy", "bob", "cy", "amy", "cy"])
    by_name = partition(np.zeros(6, np.int64), 3, "natural", seed=0, groups=names)
    assert [c.tolist() for c in by_name] == [[1, 4], [0, 2], [3, 5]]  # amy, bob, cy


def test_natural_errors() -> None:
    labels = np.zeros(6, np.int64)
    with pytest.raises(DataError, match=r"data\.partition\.column must name a column"):
        partition(labels, 2, "natural", seed=0)
    with pytest.raises(DataError, match=r"data\.num_clients = 4 is more than the 3 groups"):
        partition(labels, 4, "natural", seed=0, groups=np.array([0, 0, 1, 1, 2, 2]))
    with pytest.raises(DataError, match=r"data\.partition: client 1 has only 1 sample"):
        partition(labels, 2, "natural", seed=0, groups=np.array([0, 0, 0, 0, 0, 1]))


def test_partition_general_errors(digits: ArrayDataset) -> None:
    with pytest.raises(DataError, match=r"data\.num_clients = 0 is invalid"):
        partition(digits.labels, 0, "iid", seed=0)
    with pytest.raises(ConfigError, match=r"data\.partition\.name = 'dirichlett' .*did you mean 'dirichlet'"):
        partition(digits.labels, 3, "dirichlett", seed=0)
    with pytest.raises(DataError, match=r"data\.partition: client 7 has no samples \(iid over 8 clients\)"):
        partition(np.arange(7) % 2, 8, "iid", seed=0, min_samples=1)


def _by_thirds(request):
    """Clients 0 and 1 hold the samples of index 0 and 1 mod 3, their first half to train; the rest is a shared
    test set per label space: even classes, and odd ones in falling order."""
    from rayfed.data.partition import LabelSpace, Partition, SharedTest

    index = np.arange(len(request.labels))
    splits = tuple(np.array_split(index[index % 3 == client], 2) for client in range(request.num_clients))
    rest = index[index % 3 == 2]
    even = request.labels[rest] % 2 == 0
    return Partition(tuple((train, test) for train, test in splits),
                     (LabelSpace("even", (0, 2, 4, 6, 8)), LabelSpace("odd", (9, 7, 5, 3, 1))),
                     (SharedTest("even", rest[even]), SharedTest("odd", rest[~even], 1, exclude_own_classes=True)))


def _partition_run(partition: dict, **data) -> dict:
    return {"data": {"source": "sklearn:digits", "num_clients": 2, "partition": partition, **data},
            "federation": {"clients_per_round": 2}}


def test_a_partitioner_may_cut_train_and_test_itself_into_label_spaces_with_shared_tests(digits: ArrayDataset) -> None:
    from rayfed.config import load_config
    from rayfed.data.clients import build_federation

    federation = build_federation(load_config(_partition_run({"name": _by_thirds})).data, seed=0)
    assert [(task.index, task.name, task.class_names) for task in federation.tasks] == [
        (0, "even", ("0", "2", "4", "6", "8")), (1, "odd", ("9", "7", "5", "3", "1"))]
    (holding,) = federation.holdings
    for client, (train, test) in enumerate(holding.splits):
        held = np.flatnonzero(np.arange(len(digits)) % 3 == client)
        assert train.tolist() == held[:len(train)].tolist() and test.tolist() == held[len(train):].tolist()
    # each label space relabelled 0..k-1 in its order: odd class 9 is 0, class 1 is 4
    assert np.array_equal(holding.dataset.labels, np.where(digits.labels % 2 == 0, digits.labels // 2,
                                                           (9 - digits.labels) // 2))
    even, odd = federation.shared
    assert (even.name, even.task, even.exclude_own_classes, odd.name, odd.task, odd.exclude_own_classes) == (
        "even", 0, False, "odd", 1, True)
    assert set(digits.labels[odd.indices]) == {1, 3, 5, 7, 9}


def test_a_partition_of_label_spaces_is_checked_where_the_engine_takes_it(digits: ArrayDataset) -> None:
    from rayfed.config import load_config
    from rayfed.data.clients import build_federation
    from rayfed.data.partition import LabelSpace, Partition

    def half_the_classes(request):
        return Partition(_by_thirds(request).splits, (LabelSpace("low", (0, 1, 2, 3, 4)),))

    with pytest.raises(DataError, match="label spaces do not hold each of the 10 classes exactly once"):
        build_federation(load_config(_partition_run({"name": half_the_classes})).data, seed=0)
    with pytest.raises(DataError, match=r"data\.tasks\['a'\]\.partition\.name = .* makes 2 tasks of one dataset"):
        build_federation(load_config({"data": {"tasks": [{"name": "a", **_partition_run({"name": _by_thirds})["data"]}]},
                                      "federation": {"clients_per_round": 2}}).data, seed=0)
    with pytest.raises(DataError, match="global_test_samples cannot be used"):
        build_federation(load_config(_partition_run({"name": _by_thirds, "global_test_samples": 5})).data, seed=0)
    with pytest.raises(DataError, match="data.partition.options is set but data.partition.name = 'iid' takes no options"):
        partition(digits.labels, 2, "iid", seed=0, options={"shots": 4})


# ---------------------------------------------------------------------------------------------
# Train / test split


def test_split_train_test_is_stratified_per_client(digits: ArrayDataset) -> None:
    clients = partition(digits.labels, 10, "dirichlet", seed=0, alpha=0.3)
    splits = split_train_test(clients, digits.labels, 0.25, seed=0)
    assert len(splits) == len(clients)
    for indices, (train, test) in zip(clients, splits):
        assert len(train) >= 1 and len(test) >= 1
        assert len(np.intersect1d(train, test)) == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), indices)
        assert len(test) == round(0.25 * len(indices))
        class_sizes = np.bincount(digits.labels[indices], minlength=10)
        test_sizes = np.bincount(digits.labels[test], minlength=10)
        # each class contributes about 25% of its samples, and keeps >= 1 training sample
        assert (np.abs(test_sizes - 0.25 * class_sizes) < 1.0 + 1e-9).all()
        if class_sizes[class_sizes > 0].min() >= 2:
            assert set(digits.labels[test]) <= set(digits.labels[train])


def test_split_train_test_deterministic_and_small_clients(digits: ArrayDataset) -> None:
    clients = partition(digits.labels, 4, "iid", seed=0)
    first = split_train_test(clients, digits.labels, 0.3, seed=1)
    again = split_train_test(clients, digits.labels, 0.3, seed=1)
    other = split_train_test(clients, digits.labels, 0.3, seed=2)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(first, again))
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(first, other))
    # three singleton classes still give one test sample; two samples of one class split 1 / 1
    labels = np.array([0, 1, 2, 3, 3])
    (train_a, test_a), (train_b, test_b) = split_train_test([np.arange(3), np.array([3, 4])], labels, 0.1, seed=0)
    assert (len(train_a), len(test_a), len(train_b), len(test_b)) == (2, 1, 1, 1)
    # a singleton class stays in train while another class can fill the test set
    labels = np.array([0, 1, 1, 1])
    ((train, test),) = split_train_test([np.arange(4)], labels, 0.5, seed=0)
    assert labels[train].tolist() == [0, 1] and labels[test].tolist() == [1, 1]


def test_split_train_test_errors() -> None:
    labels = np.array([0, 1, 1])
    with pytest.raises(DataError, match=r"data\.partition: client 1 has 1 sample\(s\), too few"):
        split_train_test([np.array([0, 1]), np.array([2])], labels, 0.5, seed=0)
    with pytest.raises(DataError, match=r"data\.test_fraction = 1\.0 is invalid"):
        split_train_test([np.arange(3)], labels, 1.0, seed=0)


def _captions(request):
    """A user's source of captions and, in column ``topic``, their labels."""
    return {"text": [f"caption {i}" for i in range(40)], "topic": [i % 4 for i in range(40)]}


def test_a_users_source_reads_its_labels_from_data_label_column() -> None:
    dataset = load_data(_captions, label_column="topic")
    assert dataset.labels.tolist() == [i % 4 for i in range(40)] and list(dataset.text[:2]) == ["caption 0", "caption 1"]
    with pytest.raises(DataError, match=r"^data\.source = '_captions' returned a column 'topic' rayfed does not read; "
                                        r"columns it reads: .*; if it holds the labels, set data\.label_column = 'topic'\.$"):
        load_data(_captions)
    with pytest.raises(DataError, match=r"^data\.label_column = 'topics' is not a column data\.source = '_captions' "
                                        r"returned \(did you mean 'topic'\?\); columns: text, topic\.$"):
        load_data(_captions, label_column="topics")
    with pytest.raises(DataError, match=r"^data\.label_column = 'topic' is set but data\.source = 'sklearn:digits' "
                                        r"returns an ArrayDataset, whose labels are its own"):
        load_data("sklearn:digits", label_column="topic")


def test_a_source_without_labels_names_its_columns_and_what_to_set() -> None:
    from rayfed.config import build_config
    from rayfed.data.clients import build_federation

    def captions_only(request):
        return {"text": [f"caption {i}" for i in range(40)]}

    config = build_config({"data": {"source": captions_only, "num_clients": 2, "partition": {"name": "iid"}},
                           "federation": {"clients_per_round": 2}})
    with pytest.raises(DataError, match=r"^data\.source = '.*captions_only' gives no labels, nor anything else to "
                                        r"learn \(its columns: text\); return them in a 'label' column or name their "
                                        r"column with data\.label_column, or set data\.kind \(.*classification.*\)\.$"):
        build_federation(config.data, 0)
