"""The paper configs on schema-faithful miniatures of every hub dataset they name (docs/real_data.md).

Each miniature has its dataset card's features (names, types, ClassLabel names, from tests/data/hub_class_names.json
where the card lists them), its config name and splits, and a few rows. It is written with `datasets` as the local
datasets cache that a first online `load_dataset(<id>, <config>, split=...)` leaves behind
(`<namespace>___<name>/<config>/<version>/<hash>/`, HF_DATASETS_CACHE): offline, the paper config's own call, with
its own arguments, finds it there. (datasets 5 does not read the hub cache's snapshot files offline: with
HF_HUB_OFFLINE set it goes straight to this cache, so a fake hub cache would not be read.)

The loop over configs computes what `rayfed data` prints (``Simulation.data_summary``), once per distinct data
section and seed (the summary is a function of those two alone: FedYolo's 52 configs hold 10 distinct sections);
`test_the_data_command_prints_every_client_of_a_paper_config` runs the CLI itself once. FedMosaic's, FedDAT's and
pFedMMA's DomainNet / Office-Caltech10 configs read folders that `rayfed prepare` builds; their tests are that
command's. Overrides are only the client counts of natural partitions (CelebA's 787 celebrities, FEMNIST's 532
writers), which a miniature of a few groups cannot fill.
"""

from __future__ import annotations

import copy
import functools
import io
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from offline_twins import paper_configs

from rayfed.config import load_config
from rayfed.data import load_source
from rayfed.models.image_processing import image_preprocessing
from rayfed.models.families.clip import class_prompt

ROOT = Path(__file__).resolve().parents[1]
CLASS_NAMES = json.loads((Path(__file__).parent / "data" / "hub_class_names.json").read_text())
PREPARED_ELSEWHERE = ("fedmosaic/", "feddat/")  # local folders `rayfed prepare` builds (and tests)
CELEBA_ATTRIBUTES = (
    "5_o_Clock_Shadow Arched_Eyebrows Attractive Bags_Under_Eyes Bald Bangs Big_Lips Big_Nose Black_Hair Blond_Hair "
    "Blurry Brown_Hair Bushy_Eyebrows Chubby Double_Chin Eyeglasses Goatee Gray_Hair Heavy_Makeup High_Cheekbones Male "
    "Mouth_Slightly_Open Mustache Narrow_Eyes No_Beard Oval_Face Pale_Skin Pointy_Nose Receding_Hairline Rosy_Cheeks "
    "Sideburns Smiling Straight_Hair Wavy_Hair Wearing_Earrings Wearing_Hat Wearing_Lipstick Wearing_Necklace "
    "Wearing_Necktie Young").split()


@functools.lru_cache(maxsize=None)
def _png(width: int, height: int, mode: str, shade: int) -> bytes:
    """One encoded image; rows share a few of them, so writing thousands of rows costs no encoding."""
    from PIL import Image

    image = Image.new(mode, (width, height), shade if mode == "L" else (shade, 255 - shade, shade // 2))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _images(count: int, sizes: tuple[tuple[int, int, str], ...], shades: int = 7) -> list[dict[str, Any]]:
    """``count`` images cycling through ``sizes`` ((width, height, mode)) and a few shades."""
    return [{"bytes": _png(*sizes[i % len(sizes)], 20 + 30 * (i % shades)), "path": None} for i in range(count)]


@dataclass(frozen=True)
class Miniature:
    """A hub dataset in small: ``features`` (``datasets.Features`` as a dict of feature builders), the card's config
    name, and per split its rows from ``rows(split, count)``; ``revision``: the card's commit docs/real_data.md checked."""

    repo: str
    config: str
    splits: dict[str, int]
    features: Callable[[], dict[str, Any]]
    rows: Callable[[str, int], dict[str, list[Any]]]
    revision: str = "unconfirmed"
    configs: tuple[str, ...] = field(default=())  # several configs of the same schema (MMLU's subjects)


def _names(repo: str, column: str = "label") -> list[str]:
    return CLASS_NAMES[repo][column]


def _class_label(repo: str, column: str = "label") -> Any:
    import datasets

    return datasets.ClassLabel(names=_names(repo, column))


def _image() -> Any:
    import datasets

    return datasets.Image()


def _value(dtype: str) -> Any:
    import datasets

    return datasets.Value(dtype)


def _strings() -> Any:
    import datasets

    return datasets.Sequence(datasets.Value("string"))


def _per_class(count: int, classes: int) -> list[int]:
    return [i % classes for i in range(count)]


def _grouped(sizes: list[int]) -> list[int]:
    """Group ids (1, 2, ...) of consecutive rows, ``sizes[i]`` rows of group i + 1."""
    return [group + 1 for group, size in enumerate(sizes) for _ in range(size)]


CELEBA_GROUPS = [1, 2, 3, 5, 8, 9, 12, 4, 2, 7]  # celebrities' images in the miniature's train split: 7 of 2..8
FEMNIST_GROUPS = [1, 3, 10, 121, 30, 60, 2]  # writers' samples: 5 of 2..120
MIDDLE_SHADE = 200  # the shade of the middle frame of each of the miniature's UCF101 clips


def _celeba_rows(split: str, count: int) -> dict[str, list[Any]]:
    celebs = _grouped(CELEBA_GROUPS) if split == "train" else [100 + i // 2 for i in range(count)]
    rows = {"image": _images(len(celebs), ((178, 218, "RGB"),)), "celeb_id": celebs}
    rows.update({name: [(i + k) % 3 == 0 for i in range(len(celebs))] for k, name in enumerate(CELEBA_ATTRIBUTES)})
    return rows


def _femnist_rows(split: str, count: int) -> dict[str, list[Any]]:
    writers = [f"f{group:04d}_{group % 100:02d}" for group in _grouped(FEMNIST_GROUPS)]
    return {"image": _images(len(writers), ((28, 28, "L"),)), "writer_id": writers, "hsf_id": [i % 8 for i in range(len(writers))],
            "character": _per_class(len(writers), 62)}


def _ucf_rows(split: str, count: int) -> dict[str, list[Any]]:
    """``count`` clips of 3 frames (named as UCF101's files: v_<Class>_g<group>_c<clip>), every class; the frames
    stored out of order and the middle frame (1) the only one of its shade."""
    names = _names("flwrlabs/ucf101")
    first_group = 1 if split == "train" else 20
    rows: dict[str, list[Any]] = {"image": [], "video_id": [], "clip_id": [], "frame": [], "label": []}
    for clip in range(count):
        label, group = clip % len(names), first_group + clip // len(names)
        for frame in (2, 0, 1):
            rows["image"].append({"bytes": _png(64, 48, "RGB", MIDDLE_SHADE if frame == 1 else 10), "path": None})
            rows["video_id"].append(f"v_{names[label]}_g{group:02d}")
            rows["clip_id"].append(f"v_{names[label]}_g{group:02d}_c01")
            rows["frame"].append(frame)
            rows["label"].append(label)
    return rows


def _classified(repo: str, image_sizes: tuple[tuple[int, int, str], ...], column: str = "label",
                image_column: str = "image", **extra: Callable[[int], list[Any]]) -> Callable[[str, int], dict]:
    classes = len(_names(repo, column))

    def rows(split: str, count: int) -> dict[str, list[Any]]:
        return {image_column: _images(count, image_sizes), column: _per_class(count, classes),
                **{name: make(count) for name, make in extra.items()}}
    return rows


TINY_IMAGENET_CLASSES = 200  # the card's 200 wnids (n01443537, ...); their exact list is not stored here: placeholders


def _tiny_imagenet_label() -> Any:
    import datasets

    return datasets.ClassLabel(names=[f"n{index:08d}" for index in range(TINY_IMAGENET_CLASSES)])


def _tiny_imagenet_rows(split: str, count: int) -> dict[str, list[Any]]:
    return {"image": _images(count, ((64, 64, "RGB"), (64, 64, "L"))), "label": _per_class(count, TINY_IMAGENET_CLASSES)}


MIXED = ((300, 200, "RGB"), (180, 240, "RGB"), (250, 250, "L"))  # real photos' mixed sizes, a greyscale one too
MINIATURES: dict[str, Miniature] = {m.repo: m for m in (
    Miniature("uoft-cs/cifar100", "cifar100", {"train": 1200, "test": 200},
              lambda: {"img": _image(), "fine_label": _class_label("uoft-cs/cifar100", "fine_label"),
                       "coarse_label": _class_label("uoft-cs/cifar100", "coarse_label")},
              _classified("uoft-cs/cifar100", ((32, 32, "RGB"),), "fine_label", "img",
                          coarse_label=lambda n: [i % 20 for i in range(n)]), "3841d7ccb58635ff25496fa69a67fb7985a33c3d"),
    Miniature("uoft-cs/cifar10", "plain_text", {"train": 1000, "test": 200},
              lambda: {"img": _image(), "label": _class_label("uoft-cs/cifar10")},
              _classified("uoft-cs/cifar10", ((32, 32, "RGB"),), "label", "img"), "a7820e8bc107bd765a9b45c849b4745b133b5054"),
    Miniature("flwrlabs/celeba", "img_align+identity+attr", {"train": sum(CELEBA_GROUPS), "valid": 4, "test": 4},
              lambda: {"image": _image(), "celeb_id": _value("int64"), **{a: _value("bool") for a in CELEBA_ATTRIBUTES}},
              _celeba_rows, "2d738f56e0e7f925ea36ae7c808ea925264aacec"),
    Miniature("flwrlabs/femnist", "default", {"train": sum(FEMNIST_GROUPS)},
              lambda: {"image": _image(), "writer_id": _value("string"), "hsf_id": _value("int64"),
                       "character": _class_label("flwrlabs/femnist", "character")}, _femnist_rows, "df739a2"),
    Miniature("zh-plus/tiny-imagenet", "default", {"train": 400, "valid": 200},
              lambda: {"image": _image(), "label": _tiny_imagenet_label()},
              _tiny_imagenet_rows, "b427d143d5e9bf39d5132c552063f3c5ba3facd6"),
    Miniature("ilee0022/Caltech-256", "default", {"train": 60, "validation": 6, "test": 6},
              lambda: {"image": _image(), "label": _value("int64"), "text": _value("string")},
              lambda split, n: {"image": _images(n, MIXED), "label": [i % 257 for i in range(n)],
                                "text": [f"class-{i % 257:03d}" for i in range(n)]}, "6adfe4d"),
    Miniature("zalando-datasets/fashion_mnist", "fashion_mnist", {"train": 60, "test": 20},
              lambda: {"image": _image(), "label": _class_label("zalando-datasets/fashion_mnist")},
              _classified("zalando-datasets/fashion_mnist", ((28, 28, "L"),)), "531be5e2ccc9dba0c201ad3ae567a4f3d16ecdd2"),
    Miniature("sh0416/ag_news", "default", {"train": 90, "test": 20},
              lambda: {"label": _value("int64"), "title": _value("string"), "description": _value("string")},
              lambda split, n: {"label": [1 + i % 4 for i in range(n)], "title": [f"Title {i}" for i in range(n)],
                                "description": [f"What happened, story {i}." for i in range(n)]}),
    Miniature("cais/mmlu", "professional_law", {"test": 30, "validation": 5, "dev": 5},
              lambda: {"question": _value("string"), "subject": _value("string"), "choices": _strings(),
                       "answer": _class_label("cais/mmlu", "answer")}, lambda split, n: {}, "995c2bc752764eb55fff735a8a4a06d697120f58",
              configs=("professional_law", "professional_medicine", "moral_scenarios")),
    Miniature("merve/vqav2-small", "default", {"validation": 60},
              lambda: {"image": _image(), "question": _value("string"), "multiple_choice_answer": _value("string")},
              lambda split, n: {"image": _images(n, MIXED), "question": [f"what is in picture {i}?" for i in range(n)],
                                "multiple_choice_answer": ["yes", "no", "2"] * (n // 3)}),
    Miniature("allenai/common_gen", "default", {"train": 60, "validation": 10, "test": 10},
              lambda: {"concept_set_idx": _value("int32"), "concepts": _strings(), "target": _value("string")},
              lambda split, n: {"concept_set_idx": list(range(n)), "concepts": [["ski", "mountain", "skier"]] * n,
                                "target": [f"A skier skis down the mountain {i}." for i in range(n)]},
              "792db818e8199aff8f77e183caf7d03de451b426"),
    # pFedMMA's base-to-novel datasets: 3 images a class (1 shot, 1-2 test); mixed sizes, a greyscale one too
    Miniature("flwrlabs/caltech101", "default", {"train": 3 * 101},
              lambda: {"image": _image(), "label": _class_label("flwrlabs/caltech101")},
              _classified("flwrlabs/caltech101", ((48, 32, "RGB"), (32, 40, "L"))), "3ec6286e202ebe3e1a263d74ba5d95209af41794"),
    Miniature("tanganke/dtd", "default", {"train": 2 * 47, "test": 47},
              lambda: {"image": _image(), "label": _class_label("tanganke/dtd")},
              _classified("tanganke/dtd", ((40, 40, "RGB"), (48, 32, "RGB")))),
    Miniature("dpdl-benchmark/oxford_flowers102", "default", {"train": 102, "validation": 102, "test": 102},
              lambda: {"image": _image(), "label": _class_label("dpdl-benchmark/oxford_flowers102")},
              _classified("dpdl-benchmark/oxford_flowers102", ((50, 40, "RGB"), (40, 60, "RGB"))), "544b55c"),
    Miniature("ethz/food101", "default", {"train": 2 * 101, "validation": 101},
              lambda: {"image": _image(), "label": _class_label("ethz/food101")},
              _classified("ethz/food101", ((51, 38, "RGB"), (38, 51, "RGB"))), "f58ff831b833746677822e16a580aa161a32742f"),
    Miniature("timm/oxford-iiit-pet", "default", {"train": 2 * 37, "test": 37},
              lambda: {"image": _image(), "label": _class_label("timm/oxford-iiit-pet"), "image_id": _value("string"),
                       "label_cat_dog": _class_label("timm/oxford-iiit-pet", "label_cat_dog")},
              _classified("timm/oxford-iiit-pet", ((50, 37, "RGB"), (37, 50, "RGB")),
                          image_id=lambda n: [f"pet_{i}" for i in range(n)], label_cat_dog=lambda n: [i % 2 for i in range(n)]),
              "10b688881011725fa2fa3d856a47536c9a7e6968"),
    Miniature("tanganke/sun397", "default", {"train": 2 * 397, "test": 397},
              lambda: {"image": _image(), "label": _class_label("tanganke/sun397")},
              _classified("tanganke/sun397", ((61, 40, "RGB"), (40, 40, "RGB"))), "4382ca2e38a3adce5eb4be428f8a2bb5a9b840ab"),
    Miniature("flwrlabs/ucf101", "default", {"train": 2 * 101, "test": 101},
              lambda: {"image": _image(), "video_id": _value("string"), "clip_id": _value("string"), "frame": _value("int64"),
                       "label": _class_label("flwrlabs/ucf101")}, _ucf_rows, "76f5acf"),
)}
def _mmlu_rows(subject: str, count: int) -> dict[str, list[Any]]:
    return {"question": [f"Question {i} on {subject}?" for i in range(count)], "subject": [subject] * count,
            "choices": [["yes", "no", "maybe", "never"]] * count, "answer": [i % 4 for i in range(count)]}


def write_miniature(miniature: Miniature, cache: Path, work: Path) -> None:
    """``miniature`` in ``cache`` as `load_dataset` leaves a prepared hub dataset: one folder per config."""
    import datasets
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = miniature.repo.split("/")
    features = datasets.Features(miniature.features())
    for config in miniature.configs or (miniature.config,):
        files = {}
        for split, count in miniature.splits.items():
            columns = _mmlu_rows(config, count) if miniature.repo == "cais/mmlu" else miniature.rows(split, count)
            path = work / f"{name}-{config}-{split}.parquet"
            datasets.Dataset.from_dict(columns, features=features).to_parquet(path)
            files[split] = [str(path)]
        builder = Parquet(cache_dir=str(work / "built"), dataset_name=name, config_name=config, data_files=files,
                          features=features, hash=miniature.revision[:16])
        builder.download_and_prepare()
        target = cache / f"{namespace}___{camelcase_to_snakecase(name)}" / config / "0.0.0" / miniature.revision[:16]
        shutil.copytree(builder.cache_dir, target)
        info = json.loads((target / "dataset_info.json").read_text())
        (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": config}))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    """Every miniature in a fresh datasets cache, offline, for this module's tests."""
    import datasets
    import huggingface_hub.constants

    root = tmp_path_factory.mktemp("hub")
    work = root / "work"
    work.mkdir()
    for miniature in MINIATURES.values():
        write_miniature(miniature, root / "datasets", work)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets")
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield root / "datasets"


# Which paper config sections name which hub dataset ----------------------------------------------------------------
def _hub_repo(source: str) -> str | None:
    """The hub dataset a section's source reads: ``hf:<id>``, or a ``tap:`` recipe's (methods/tap/data.py)."""
    from rayfed.methods.tap.data import TAP_DATASETS

    if source.startswith("hf:") and "/" in source:
        return source.removeprefix("hf:")
    if source.startswith("tap:"):
        return TAP_DATASETS[source.removeprefix("tap:").partition("/")[0]][0]
    return None


def _raw_sections(raw: dict[str, Any]) -> list[dict[str, Any]]:
    data = raw["data"]
    return list(data["tasks"]) if data.get("tasks") else [data]


@functools.lru_cache(maxsize=1)
def checked_configs() -> list[Path]:
    """The paper configs this module loads: all but those reading folders `rayfed prepare` builds."""
    return [path for path in paper_configs(ROOT)
            if not path.relative_to(ROOT / "configs").as_posix().startswith(PREPARED_ELSEWHERE)
            and all("path" not in section for section in _raw_sections(yaml.safe_load(path.read_text())))]


def _name(path: Path) -> str:
    return path.relative_to(ROOT / "configs").as_posix()


@functools.lru_cache(maxsize=1)
def hub_sections() -> dict[str, tuple[Path, int]]:
    """Per hub dataset, the first checked config naming it and the index of the section that does."""
    found: dict[str, tuple[Path, int]] = {}
    for path in checked_configs():
        for index, section in enumerate(_raw_sections(yaml.safe_load(path.read_text()))):
            repo = _hub_repo(str(section["source"]))
            if repo is not None:
                found.setdefault(repo, (path, index))
    return found


def test_every_hub_dataset_a_paper_config_names_has_a_miniature_and_every_miniature_is_named():
    assert sorted(hub_sections()) == sorted(MINIATURES)
    assert len(checked_configs()) == 2 + 52 + 9  # TAP, FedYolo, pFedMMA's hub datasets


# One dataset through its paper config's section --------------------------------------------------------------------
def _rows_read(miniature: Miniature, section: Any, default_split: str) -> int:
    """The rows of the miniature that ``section`` reads, after the filters that precede decoding."""
    rows = sum(miniature.splits[split] for split in (section.split or default_split).split("+"))
    if miniature.repo == "flwrlabs/celeba":
        rows = sum(size for size in CELEBA_GROUPS if 2 <= size <= 8)
    if miniature.repo == "flwrlabs/femnist":
        rows = sum(size for size in FEMNIST_GROUPS if 2 <= size <= 120)
    # flwrlabs/ucf101's split sizes count clips (of 3 frame rows each): one frame a clip is read
    return min(rows, section.max_samples or rows)


@pytest.mark.parametrize("repo", sorted(MINIATURES))
def test_each_hub_dataset_loads_through_its_paper_config_with_the_cards_columns_and_classes(hub, repo):
    from rayfed.methods.tap.data import AG_NEWS_CLASSES, TAP_DATASETS

    path, index = hub_sections()[repo]
    config = load_config(path)
    section = (config.data.tasks or (config.data,))[index]
    recipe = str(section.source).removeprefix("tap:").partition("/")[0]
    default_split = TAP_DATASETS[recipe][1] if str(section.source).startswith("tap:") else "train"
    miniature = MINIATURES[repo]
    processing = image_preprocessing(config.model) if section.resize == "backbone" else None
    loaded = load_source(section, config.seed, image_processing=processing)
    assert len(loaded) == _rows_read(miniature, section, default_split)

    label_column = section.label_column if not str(section.source).startswith("tap:") else None
    if repo == "sh0416/ag_news":  # labels 1..4 on the hub, 0..3 here (the authors' code subtracts 1)
        assert loaded.class_names == AG_NEWS_CLASSES and sorted(set(loaded.labels)) == [0, 1, 2, 3]
    elif label_column in CLASS_NAMES.get(repo, {}):
        assert loaded.class_names == tuple(CLASS_NAMES[repo][label_column])
    elif repo == "flwrlabs/celeba":  # Smiling is a bool column: two classes by value
        assert loaded.class_names == ("False", "True")
    elif repo == "zh-plus/tiny-imagenet":
        assert len(loaded.class_names) == TINY_IMAGENET_CLASSES

    if loaded.images is not None:
        first = miniature.rows(next(iter(miniature.splits)), 1)  # the card's image: (width, height, mode)
        if isinstance(section.resize, int):
            assert loaded.images.shape[1:] == (section.resize, section.resize, 3)
        elif section.resize is None and str(section.source).startswith("hf:"):
            from PIL import Image

            with Image.open(io.BytesIO(next(iter(first.values()))[0]["bytes"])) as image:
                shape = (image.height, image.width, len(image.getbands()))
            assert loaded.images.shape[1:] == shape
    if repo == "flwrlabs/ucf101":  # the middle frame of every clip, whatever the order the frames are stored in
        scale = 255 if np.issubdtype(loaded.images.dtype, np.integer) else 1  # uint8 or [0, 1] floats
        assert np.allclose(loaded.images[..., 0] / scale, MIDDLE_SHADE / 255, atol=0.02)
    if str(section.source).startswith("tap:"):
        assert all(isinstance(text, str) and text for text in loaded.text)
        if repo == "cais/mmlu":
            assert loaded.target[0] == "Correct answer on law: A. yes"
        if repo == "allenai/common_gen":
            assert loaded.text[0].endswith("Concepts: A. ski B. mountain C. skier")


def test_clip_prompts_read_every_pfedmma_class_name_in_words():
    assert class_prompt("ApplyEyeMakeup") == "a photo of a Apply Eye Makeup."  # UCF101, as CoOp renames it
    assert class_prompt("american_pit_bull_terrier") == "a photo of a american pit bull terrier."
    assert class_prompt("pink-yellow dahlia?") == "a photo of a pink-yellow dahlia?."
    for repo in ("flwrlabs/caltech101", "tanganke/dtd", "dpdl-benchmark/oxford_flowers102", "ethz/food101",
                 "timm/oxford-iiit-pet", "tanganke/sun397", "flwrlabs/ucf101"):
        for name in CLASS_NAMES[repo]["label"]:
            words = class_prompt(name).removeprefix("a photo of a ").removesuffix(".")
            assert "_" not in words and not any(a.islower() and b.isupper() for a, b in zip(words, words[1:])), name


# `rayfed data` on every paper config -------------------------------------------------------------------------------
CLIENTS_A_MINIATURE_FILLS = {"shards": 4, "labeldir": 10}  # CIFAR's 20 and 100 clients need thousands of images
GLOBAL_TEST_SAMPLES = 200  # the CIFAR-100 configs' global test set: 2,000 in the paper


def size_overrides(raw: dict[str, Any]) -> list[str]:
    """The sizes a miniature cannot fill, cut to what it holds: natural partitions to its groups (CelebA's 787
    celebrities, FEMNIST's 532 writers); CIFAR's shards and label-Dirichlet clients to a few, each shard client to one
    train and one test sample of each of its classes (the paper: 100 + 100 samples), CIFAR-100's global test set to 200;
    pFedMMA's shots to 1; the clients a round to match. Nothing else."""
    groups = {"hf:flwrlabs/celeba": (CELEBA_GROUPS, 8), "hf:flwrlabs/femnist": (FEMNIST_GROUPS, 120)}
    tasks = raw["data"].get("tasks")
    overrides, per_round = [], []
    for index, section in enumerate(_raw_sections(raw)):
        prefix = f"data.tasks.{index}." if tasks else "data."
        partition = section.get("partition", {})
        if section["source"] in groups:
            sizes, largest = groups[section["source"]]
            clients = sum(1 for size in sizes if 2 <= size <= largest)
        else:
            clients = CLIENTS_A_MINIATURE_FILLS.get(partition.get("name"), section.get("num_clients"))
        if clients != section.get("num_clients"):
            overrides.append(f"{prefix}num_clients={clients}")
        if "global_test_samples" in partition:
            overrides.append(f"{prefix}partition.global_test_samples={GLOBAL_TEST_SAMPLES}")
        if partition.get("name") == "base_novel":  # the miniature's 2-3 images a class: 1 shot (the paper: 16)
            overrides.append(f"{prefix}partition.options.shots=1")
        if partition.get("name") == "shards":  # one train and one test sample of each of a client's classes
            overrides += [f"{prefix}partition.{key}={partition['classes_per_client']}"
                          for key in ("samples_per_client", "test_samples_per_client") if key in partition]
        if tasks and section.get("clients_per_round"):
            per_round.append(min(section["clients_per_round"], clients))
            if per_round[-1] != section["clients_per_round"]:
                overrides.append(f"{prefix}clients_per_round={per_round[-1]}")
        elif not tasks and clients is not None and clients < raw["federation"]["clients_per_round"]:
            overrides.append(f"federation.clients_per_round={clients}")
    if per_round and sum(per_round) != raw["federation"]["clients_per_round"]:
        overrides.append(f"federation.clients_per_round={sum(per_round)}")
    return overrides


_SUMMARIES: dict[str, dict[str, Any]] = {}


@pytest.mark.parametrize("path", checked_configs(), ids=_name)
def test_rayfed_data_runs_on_every_paper_config_and_yields_its_clients_and_classes(hub, path):
    from rayfed.simulation import Simulation

    raw = yaml.safe_load(path.read_text())
    sim = Simulation(str(path), overrides=size_overrides(raw), progress=False)
    key = json.dumps([sim.config.seed, sim.config.data.model_dump(mode="json")], sort_keys=True)
    if key not in _SUMMARIES:  # the summary is a function of the data section and the seed alone
        _SUMMARIES[key] = sim.data_summary()
    summary = _SUMMARIES[key]
    data = sim.config.data
    assert sorted(summary["clients"]) == list(range(data.num_clients))
    assert all(client["num_train"] >= 1 and client["num_test"] >= 1 for client in summary["clients"].values())
    if data.tasks:
        assert summary["by"] == "task" and summary["categories"] == [task.name for task in data.tasks]
    else:
        repo = _hub_repo(str(data.source))
        expected = CLASS_NAMES[repo].get(data.label_column) if repo in CLASS_NAMES else ["False", "True"]
        assert summary["by"] == "label" and summary["categories"] == expected


def test_the_data_command_prints_every_client_of_a_paper_config(hub, tmp_path, capsys):
    from rayfed.cli import main

    assert main(["data", str(ROOT / "configs" / "tap" / "paper_vilt.yaml"), "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    clients = [line.split()[0] for line in table if line.split() and line.split()[0].isdigit()]
    assert clients == [str(client) for client in range(30)]
    assert (tmp_path / "data.png").is_file()


# GPU shares measured, not guessed ----------------------------------------------------------------------------------
# Shares backed by a recorded peak (benchmarks/README.md, the twins at paper size): GiB an actor held.
RECORDED_PEAK_GIB = {"pfedmma/cifar10.yaml": 3.5, "pfedmma/cifar100.yaml": 3.5}  # an actor of all 100 CLIP clients
SMALLEST_GPU_GIB = 78  # an H100's usable memory


def test_no_paper_config_guesses_its_gpu_share():
    """Each paper config asks for the share its actor measures, a whole GPU, or a share that holds a recorded peak
    (plus placement.memory_headroom_gib) on an 80 GB card: TAP's 4 actors at 0.25 ran out of memory."""
    from rayfed.config import PlacementConfig

    headroom = PlacementConfig().memory_headroom_gib
    for path in paper_configs(ROOT):
        share = yaml.safe_load(path.read_text())["placement"]["gpus_per_actor"]
        name = _name(path)
        if share in ("measured", 1):
            continue
        assert name in RECORDED_PEAK_GIB, f"{name} guesses gpus_per_actor = {share}"
        assert share * SMALLEST_GPU_GIB >= RECORDED_PEAK_GIB[name] + headroom, name
