"""``rayfed prepare``: each recipe converts a miniature of its public source's real layout (the archives as they are
published, the authors' JSON splits and scenario files, the split files), and the paper config then loads what it
wrote (``rayfed data``'s summary). Plus the engine's refusals: a missing file in one sentence, an archive member
that climbs out of its archive."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import zipfile
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml
from PIL import Image

from rayfed.cli import main
from rayfed.data import load_source
from rayfed.data.prepare import SourceFiles
from rayfed.data.sources import DataError
from rayfed.models.image_processing import image_preprocessing
from rayfed.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]


def _png(index: int, size: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (index * 37 % 256, index * 91 % 256, 40)).save(buffer, "PNG")
    return buffer.getvalue()


def _tar(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


# FedMosaic: SNUMPR/DRAKE's <dataset>.tar archives (images and LLaVA-style task splits) and a scenario file of the
# official repository's form, 10 clients x 4 tasks, four of them on the 1B model.
DRAKE_DATASETS = ("Fashion200K", "NLVR2", "VizWiz", "iconqa", "WCVQA")
TRAIN, TEST = 3, 2


def _llava_sample(dataset: str, k: int, split: str, index: int, images: int = 1) -> tuple[dict, dict[str, bytes]]:
    paths = [f"dataset/{dataset}/images/{k}_{split}_{index}_{i}.png" for i in range(images)]
    placeholders = "".join(f"Image {i + 1}: <image>\n" for i in range(images))
    sample = {"id": f"{dataset}-{k}-{split}-{index}", "image": paths if images > 1 else paths[0],
              "conversations": [{"from": "human", "value": f"{placeholders}Is it {index}? A. yes B. no"},
                                {"from": "gpt", "value": "A" if index % 2 else "B"}]}
    return sample, {path.removeprefix("dataset/"): _png(index + 10 * k + i) for i, path in enumerate(paths)}


BENCHMARKS = {  # the scenario file, its clients and those on the 1B model, and a paper config reading it
    "drake": ("DRAKE_hetero_llava_llama_1B_3B", 10, (0, 1, 8, 9), ("paper_drake_static.yaml",
                                                                   "paper_drake_dynamic.yaml"), "DRAKE_ROOT"),
    "hflb": ("HFLB_hetero_llava_llama_1B_3B", 9, (0, 1, 5), ("paper_hflb_dynamic.yaml",), "HFLB_ROOT"),
}


def drake_source(root: Path, multi_image: tuple[str, int] | None = None, benchmark: str = "drake"
                 ) -> list[list[tuple[str, int]]]:
    """The miniature under ``root``; each client's (dataset, k) tasks. ``multi_image``: that task's first sample has
    two images."""
    scenario_name, clients, small, _, _ = BENCHMARKS[benchmark]
    tasks = [[(DRAKE_DATASETS[(c + t) % 5], (c + 2 * t) % 4) for t in range(4)] for c in range(clients)]
    scenario = [{"client_id": c, "datasets": [{"dataset": d, "subset_id": k, "type": "multi-choice"} for d, k in held],
                 "model_id": "thkim0305/llama3.2_1B_vl" if c in small else "thkim0305/llama3.2_3B_vl"}
                for c, held in enumerate(tasks)]
    (root / "scenarios").mkdir(parents=True)
    (root / "scenarios" / f"{scenario_name}.json").write_text(json.dumps(scenario, indent=4))
    for dataset in DRAKE_DATASETS:
        members: dict[str, bytes] = {}
        for k in range(4):
            for split, count in (("train", TRAIN), ("test", TEST)):
                samples = []
                for index in range(count):
                    images = 2 if multi_image == (dataset, k) and index == 0 and split == "train" else 1
                    sample, files = _llava_sample(dataset, k, split, index, images)
                    samples.append(sample)
                    members.update(files)
                members[f"{dataset}/{split}/dataset-{k}.json"] = json.dumps(samples).encode()
        _tar(root / f"{dataset}.tar", members)
    mixture, images = [], {}
    for index in range(8):  # LLaVA-v1.5's mixture: COCO and GQA images, multi-turn, and text-only samples
        folder = ("coco/train2017", "gqa/images")[index % 2]
        turns = [{"from": "human", "value": f"<image>\nWhat is {index}?"}, {"from": "gpt", "value": f"It is {index}."},
                 {"from": "human", "value": "And then?"}, {"from": "gpt", "value": "Nothing."}]
        mixture.append({"id": str(index), "image": f"{folder}/{index:012d}.jpg", "conversations": turns})
        mixture.append({"id": f"text{index}", "conversations": turns[:2]})
        images[f"{folder.split('/')[-1]}/{index:012d}.jpg"] = _png(index)
    (root / "llava_v1_5_mix665k.json").write_text(json.dumps(mixture))
    _zip(root / "train2017.zip", {k: v for k, v in images.items() if k.startswith("train2017")})
    for name, data in images.items():
        if name.startswith("images/"):
            (root / "gqa" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "gqa" / name).write_bytes(data)
    return tasks


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_drake_and_hflb_convert_and_the_paper_config_loads_every_client_and_task(benchmark, tmp_path, capsys,
                                                                                 monkeypatch):
    _, clients, small, config_names, variable = BENCHMARKS[benchmark]
    tasks = drake_source(tmp_path / "src", benchmark=benchmark)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", benchmark, "--out", "drake", "--source", str(tmp_path / "src")]) == 0
    out = capsys.readouterr().out
    assert f"client{clients - 1}/task3" in out and f"export {variable}=drake" in out
    task = datasets.load_from_disk(str(tmp_path / "drake" / "client2" / "task1"))
    assert task.features["image"] == datasets.Image() and task.num_rows == TRAIN + TEST
    assert task["split"] == ["train"] * TRAIN + ["test"] * TEST
    dataset, k = tasks[2][1]
    assert task[0]["question"].startswith("Image 1: <image>\n") and task[0]["answer"] == "B"
    assert np.asarray(task[TRAIN]["image"]).tolist() == np.asarray(Image.open(io.BytesIO(_png(10 * k)))).tolist()
    public = datasets.load_from_disk(str(tmp_path / "drake" / "public_llava_instruct_5k"))
    assert public.num_rows == 8 and set(public.column_names) == {"question", "answer", "image"}
    assert sorted(public["answer"]) == [f"It is {i}." for i in range(8)]  # image samples only, first turn only
    manifest = json.loads((tmp_path / "drake" / "scenario.json").read_text())
    assert [t["dataset"] for t in manifest["clients"][7]["tasks"]] == [d for d, _ in tasks[7]]

    monkeypatch.setenv(variable, "drake")  # as the recipe says: export DRAKE_ROOT=drake (HFLB_ROOT)
    # data.resize: backbone reads the checkpoints' processors; offline, the tiny LLaVAs stand in for them
    offline = ["model.backbone=tiny-pretrained:llava", "architectures.llama1b.backbone=tiny-pretrained:llava",
               "architectures.llama3b.backbone=tiny-pretrained:llava-large"]
    for config_name in config_names:
        sim = Simulation(ROOT / "configs" / "fedmosaic" / config_name, overrides=offline, progress=False)
        summary = sim.data_summary()
        assert summary["by"] == "task" and len(summary["categories"]) == 4 * clients
        assert {cid: (c["num_train"], c["num_test"]) for cid, c in summary["clients"].items()} == {
            cid: (4 * TRAIN, 4 * TEST) for cid in range(clients)}
        assert sim.config.architectures["llama1b"].clients == small  # the scenario's 1B clients
    assert {task.resize for task in sim.config.data.tasks} == {sim.config.data.public.resize} == {"backbone"}
    processing = image_preprocessing(sim.config.model)
    assert len(load_source(sim.config.data.public, 0, image_processing=processing).target) == 8


def test_a_task_with_a_multi_image_sample_holds_lists_of_images(tmp_path):
    drake_source(tmp_path / "src", multi_image=("NLVR2", 1))
    assert main(["prepare", "drake", "--out", str(tmp_path / "drake"), "--source", str(tmp_path / "src")]) == 0
    manifest = json.loads((tmp_path / "drake" / "scenario.json").read_text())
    multi = [(c["client"], t) for c in manifest["clients"] for t, task in enumerate(c["tasks"]) if task["multi_image"]]
    assert multi and {(manifest["clients"][c]["tasks"][t]["dataset"], manifest["clients"][c]["tasks"][t]["subset_id"])
                      for c, t in multi} == {("NLVR2", 1)}
    client, t = multi[0]
    task = datasets.load_from_disk(str(tmp_path / "drake" / f"client{client}" / f"task{t}"))
    assert task.features["image"] == datasets.Sequence(datasets.Image())
    assert [len(images) for images in task["image"]] == [2] + [1] * (TRAIN + TEST - 1)
    assert task[0]["question"].count("<image>") == 2
    # the loader reads it as samples of several images, as the paper config asks for it
    from rayfed.config import DataConfig

    section = DataConfig(source=f"hf:{tmp_path}/drake/client{client}/task{t}", kind="text_generation",
                         text_column="question", target_column="answer")
    loaded = load_source(section, 0)
    assert loaded.images.shape[:2] == (TRAIN + TEST, 2) and loaded.image_counts.tolist() == [2] + [1] * (TRAIN + TEST - 1)


def test_a_missing_task_file_is_one_sentence_naming_it_and_where_to_get_it(tmp_path, capsys):
    drake_source(tmp_path / "src")
    (tmp_path / "src" / "WCVQA.tar").unlink()
    code = main(["prepare", "drake", "--out", str(tmp_path / "drake"), "--source", str(tmp_path / "src")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and not (tmp_path / "drake").exists()
    # offline, the hub download of the missing archive fails: the sentence names it and the hub dataset
    assert err.startswith("rayfed: error: WCVQA.tar, WCVQA/* could not be downloaded from the hub dataset SNUMPR/DRAKE")
    assert "https://huggingface.co/datasets/SNUMPR/DRAKE" in err


def test_an_archive_member_that_climbs_out_is_refused(tmp_path):
    _tar(tmp_path / "evil.tar", {"Fashion200K/train/dataset-0.json": b"[]", "../outside.png": _png(0)})
    with pytest.raises(DataError, match=r"evil.tar holds a member named '../outside.png', which points outside"):
        SourceFiles([tmp_path])
    _zip(tmp_path / "other" / "evil.zip", {"/etc/passwd": b"x"})
    with pytest.raises(DataError, match="'/etc/passwd', which points outside"):
        SourceFiles([tmp_path / "other"])


def test_a_path_is_found_by_its_longest_matching_end(tmp_path):
    _zip(tmp_path / "train2017.zip", {"train2017/1.jpg": b"a"})
    (tmp_path / "val2017").mkdir()
    (tmp_path / "val2017" / "1.jpg").write_bytes(b"b")
    files = SourceFiles([tmp_path])
    assert files.read(files.find("coco/train2017/1.jpg")) == b"a"
    assert files.read(files.find("val2017/1.jpg")) == b"b"
    assert files.find("test2017/1.jpg") is None  # the file name alone is not enough
    with pytest.raises(DataError, match=r"1.jpg matches 2 files"):
        files.find("1.jpg")


# FedDAT's Domain benchmark: each dataset's release, in a folder of its own.
def _answers(index: int) -> str:
    return ("yes", "no")[index % 2] if index % 7 else "red"  # of 14: yes 6, no 6, red 2; of 7: 3, 3, 1


def feddat_source(root: Path) -> None:
    vizwiz = {split: [{"image": f"VizWiz_{split}_{i:08d}.jpg", "question": f"what is {i}?", "answerable": 1,
                       "answers": [{"answer": _answers(i), "answer_confidence": "yes"}] * 2
                       + [{"answer": "blurry", "answer_confidence": "no"}]} for i in range(count)]
              for split, count in (("train", 14), ("val", 7))}
    _zip(root / "vizwiz" / "Annotations.zip", {f"{split}.json": json.dumps(v).encode() for split, v in vizwiz.items()})
    for split, questions in vizwiz.items():
        _zip(root / "vizwiz" / f"{split}.zip", {f"{split}/{q['image']}": _png(i) for i, q in enumerate(questions)})
    members, images = {}, {"train2014": {}, "val2014": {}}
    for split, coco, count in (("train", "train2014", 14), ("test", "val2014", 7)):
        members[f"{split}/questions.txt"] = "\n".join(f"what is on the table {i}" for i in range(count)).encode()
        members[f"{split}/answers.txt"] = "\n".join(_answers(i) for i in range(count)).encode()
        members[f"{split}/img_ids.txt"] = "\n".join(str(100 + i) for i in range(count)).encode()
        members[f"{split}/types.txt"] = "\n".join("0" for _ in range(count)).encode()
        images[coco] = {f"{coco}/COCO_{coco}_{100 + i:012d}.jpg": _png(i) for i in range(count)}
    _zip(root / "cocoqa" / "cocoqa-2015-05-17.zip", members)
    for coco, files in images.items():
        _zip(root / "cocoqa" / f"{coco}.zip", files)
    semart = {}
    for split, count in (("train", 14), ("test", 7)):
        questions = [{"image": f"{split}{i}.jpg", "question": f"who painted {i}?", "answer": _answers(i),
                      "need_external_knowledge": bool(i % 2)} for i in range(count)]
        (root / "aqua").mkdir(parents=True, exist_ok=True)
        (root / "aqua" / f"{split}.json").write_text(json.dumps(questions))
        semart.update({f"SemArt/Images/{q['image']}": _png(i) for i, q in enumerate(questions)})
    _zip(root / "aqua" / "SemArt.zip", semart)
    gqa = {split: {str(5000 + 100 * s + i): {"imageId": str(700 + 100 * s + i), "question": f"is it {i}?",
                                             "answer": _answers(i), "fullAnswer": "..."} for i in range(count)}
           for s, (split, count) in enumerate((("train", 14), ("val", 7)))}
    _zip(root / "gqa" / "questions1.2.zip", {f"{split}_balanced_questions.json": json.dumps(q).encode()
                                             for split, q in gqa.items()})
    _zip(root / "gqa" / "images.zip", {f"images/{q['imageId']}.jpg": _png(i) for split in gqa
                                       for i, q in enumerate(gqa[split].values())})
    for split, zipped, count in (("train2015", "Train", 14), ("val2015", "Val", 7)):
        questions = [{"question_id": 10 * i, "image_id": i, "question": f"where is {i}?"} for i in range(count)]
        annotations = [{"question_id": 10 * i, "image_id": i, "multiple_choice_answer": _answers(i),
                        "answers": [{"answer": _answers(i), "answer_id": 1}]} for i in range(count)]
        _zip(root / "vqa_abstract" / f"Questions_{zipped}_abstract_v002.zip",
             {f"OpenEnded_abstract_v002_{split}_questions.json": json.dumps({"questions": questions}).encode()})
        _zip(root / "vqa_abstract" / f"Annotations_{zipped}_abstract_v002.zip",
             {f"abstract_v002_{split}_annotations.json": json.dumps({"annotations": annotations}).encode()})
        _zip(root / "vqa_abstract" / f"scene_img_abstract_v002_{split}.zip",
             {f"abstract_v002_{split}_{i:012d}.png": _png(i) for i in range(count)})


def test_feddat_domain_keeps_the_top_answers_draws_its_samples_and_the_paper_config_loads(tmp_path, monkeypatch,
                                                                                          capsys):
    from rayfed.methods.feddat import prepare as recipe

    feddat_source(tmp_path / "src")
    monkeypatch.setattr(recipe, "ANSWERS", 2)
    monkeypatch.setattr(recipe, "TRAIN_SAMPLES", 10)
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "feddat-domain", "--source", str(tmp_path / "src")]) == 0  # the config's data/feddat
    assert "vizwiz: 2 answers, 10 train + 6 test samples (the paper: 2, 10 + 500)" in capsys.readouterr().out
    for name in ("vizwiz", "cocoqa", "aqua", "gqa", "vqa_abstract"):
        client = datasets.load_from_disk(str(tmp_path / "data" / "feddat" / name))
        assert client.features["answer"].names == ["no", "yes"], name  # 6 each, then by name
        assert client["split"] == ["train"] * 10 + ["test"] * 6, name  # 12 kept of 14 (10 drawn), 6 of 7
        assert "red" not in {client.features["answer"].int2str(a) for a in client["answer"]}
        assert client[0]["image"].size == (8, 8)
    paper = ROOT / "configs" / "feddat" / "paper_domain.yaml"
    summary = Simulation(paper, overrides=[f"data.tasks.{i}.resize=8" for i in range(5)], progress=False).data_summary()
    assert summary["categories"] == ["vizwiz", "cocoqa", "art", "gqa", "abstract"]
    assert [c["num_train"] + c["num_test"] for c in summary["clients"].values()] == [16] * 5


@pytest.mark.parametrize("config_name", ["paper_function.yaml", "paper_scene.yaml"])
def test_the_clove_configs_load_folders_of_the_documented_layout(config_name, tmp_path, monkeypatch):
    """CLOVE has no public source in FedDAT's form (docs/feddat.md): a user builds one save_to_disk folder a task
    with image, question, answer; the paper config then reads each as one client."""
    paper = ROOT / "configs" / "feddat" / config_name
    tasks = yaml.safe_load(paper.read_text())["data"]["tasks"]
    for k, task in enumerate(tasks):
        images = [Image.fromarray(np.full((8 + k, 8, 3), 10 * i, np.uint8)) for i in range(6)]
        datasets.Dataset.from_dict({"image": images, "question": [f"what is {i}?" for i in range(6)],
                                    "answer": ["yes", "no", "two"] * 2}).save_to_disk(str(tmp_path / task["path"]))
    monkeypatch.chdir(tmp_path)
    summary = Simulation(paper, overrides=[f"data.tasks.{i}.resize=8" for i in range(len(tasks))],
                         progress=False).data_summary()
    assert summary["categories"] == [task["name"] for task in tasks]
    assert [c["num_train"] + c["num_test"] for c in summary["clients"].values()] == [6] * len(tasks)


@pytest.mark.parametrize(("removed", "missing", "get_it"), [
    ("cocoqa/val2014.zip", "COCO_val2014_000000000100.jpg",
     "its images are in http://images.cocodataset.org/zips/val2014.zip; pass it with --source."),
    ("aqua/test.json", "test.json", "it is in https://github.com/noagarcia/ArtVQA/tree/master/AQUA."),
], ids=["coco-images", "aqua-questions"])
def test_a_manual_download_that_is_missing_is_named_with_its_address(removed, missing, get_it, tmp_path, capsys):
    feddat_source(tmp_path / "src")
    (tmp_path / "src" / removed).unlink()
    assert main(["prepare", "feddat-domain", "--out", str(tmp_path / "out"), "--source", str(tmp_path / "src")]) == 2
    err = capsys.readouterr().err.strip()
    folder = tmp_path / "src" / removed.split("/")[0]
    assert err == f"rayfed: error: {missing} is missing from {folder}; {get_it}"
    assert not (tmp_path / "out").exists()  # every file is checked before anything is written


def test_clove_says_in_one_sentence_that_it_has_no_public_source(capsys):
    assert main(["prepare", "clove"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "FedDAT's README lists their download as 'TODO'" in err


# pFedMMA: FedBN's split files (pickles of image paths and class names) and the images' archives.
def _fedbn_split(paths: list[str], labels: list[str]) -> bytes:
    return pickle.dumps((np.array(paths), np.array(labels)))


def feature_shift_source(root: Path, domains: tuple[str, ...], classes: tuple[str, ...], folder: str,
                         images_inside: bool) -> None:
    splits, images = {}, {}
    for domain in domains:
        for split, count in (("train", 4), ("test", 1)):
            paths = [f"{folder}/{domain}/{c}/{domain}_{split}_{i}.jpg" for c in classes for i in range(count)]
            splits[f"{folder}/{domain}_{split}.pkl"] = _fedbn_split(paths, [p.split("/")[2] for p in paths])
            images.update({path: _png(i) for i, path in enumerate(paths)})
    archive = {**splits, **images} if images_inside else splits
    _zip(root / ("office_caltech_10_dataset.zip" if images_inside else "domainnet_dataset.zip"), archive)
    if not images_inside:  # DomainNet's per-domain zips hold <domain>/<class>/<file>, and classes FedBN left out
        for domain in domains:
            _zip(root / f"{domain}.zip", {**{path.split("/", 1)[1]: data for path, data in images.items()
                                             if path.split("/")[1] == domain}, f"{domain}/zigzag/x.jpg": _png(0)})


@pytest.mark.parametrize("benchmark", ["domainnet", "office-caltech10"])
def test_a_feature_shift_dataset_converts_and_its_config_loads_every_domain(benchmark, tmp_path, monkeypatch):
    from rayfed.methods.pfedmma.prepare import DOMAINNET, OFFICE_CALTECH10

    bench = DOMAINNET if benchmark == "domainnet" else OFFICE_CALTECH10
    feature_shift_source(tmp_path / "src", bench.domains, bench.classes,
                         "DomainNet" if benchmark == "domainnet" else "office_caltech_10", benchmark != "domainnet")
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", benchmark, "--source", str(tmp_path / "src")]) == 0
    written = datasets.load_from_disk(bench.out)
    assert written.features["label"].names == list(bench.classes)
    assert written.num_rows == 50 * len(bench.domains) and written["split"].count("test") == 10 * len(bench.domains)
    assert sorted(set(written["domain"])) == sorted(bench.domains)
    config = ROOT / "configs" / "pfedmma" / ("domainnet.yaml" if benchmark == "domainnet" else "office_caltech10.yaml")
    overrides = ["data.resize=8", "data.partition.min_samples=4"]
    summary = Simulation(config, overrides=overrides, progress=False).data_summary()
    assert summary["by"] == "label" and summary["categories"] == list(bench.classes)
    assert len(summary["clients"]) == 2 * len(bench.domains)
    assert summary["total"]["num_train"] + summary["total"]["num_test"] == 50 * len(bench.domains)


def test_a_split_file_that_would_run_code_is_refused(tmp_path, capsys):
    class Exploit:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "src").mkdir()
    for domain in ("amazon", "caltech", "dslr", "webcam"):
        for split in ("train", "test"):
            (tmp_path / "src" / f"{domain}_{split}.pkl").write_bytes(pickle.dumps(([Exploit()], ["bike"])))
    assert main(["prepare", "office-caltech10", "--out", str(tmp_path / "out"), "--source", str(tmp_path / "src")]) == 2
    captured = capsys.readouterr()
    assert "pwned" not in captured.out
    assert "amazon_train.pkl is not FedBN's split file (a pickle of image paths and class names: builtins.print is " \
           "not part of a numpy array)" in captured.err


def test_presplit_deals_each_of_the_datasets_splits_over_the_clients_and_refuses_other_values():
    from rayfed.data.partition import partition

    splits = np.array(["train", "test"] * 5 + ["train"] * 4)  # 9 train, 5 test
    cut = partition(np.zeros(len(splits), dtype=np.int64), 2, "presplit", seed=3, groups=splits)
    assert [(len(train), len(test)) for train, test in cut.splits] == [(5, 3), (4, 2)]
    assert all(set(splits[train]) == {"train"} and set(splits[test]) == {"test"} for train, test in cut.splits)
    with pytest.raises(DataError, match="data.partition.column holds the split 'val'; data.partition.name = 'presplit' "
                                        "takes 'train' and 'test' only."):
        partition(np.zeros(3, dtype=np.int64), 1, "presplit", seed=0, groups=np.array(["train", "val", "test"]))
    with pytest.raises(DataError, match="client 0 has no test samples"):
        partition(np.zeros(2, dtype=np.int64), 1, "presplit", seed=0, groups=np.array(["train", "train"]))


def test_what_the_sources_lack_is_downloaded_from_the_hub_and_only_the_files_asked_for_are_read(tmp_path, monkeypatch):
    from rayfed.methods.pfedmma.prepare import OFFICE_CALTECH10

    snapshot = tmp_path / "snapshot"  # the hub's cache folder of the repository, with a file asked for earlier
    feature_shift_source(snapshot, OFFICE_CALTECH10.domains, OFFICE_CALTECH10.classes, "office_caltech_10", True)
    _zip(snapshot / "other" / "office_caltech_10_dataset.zip", {"amazon_train.pkl": b"not FedBN's"})
    asked = []

    def snapshot_download(repo_id: str, repo_type: str, allow_patterns: list[str]) -> str:
        asked.append((repo_id, repo_type, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    assert main(["prepare", "office-caltech10", "--out", str(tmp_path / "out")]) == 0
    assert asked == [("Jemary/FedBN_Dataset", "dataset", ["office_caltech_10_dataset.zip"])]
    assert datasets.load_from_disk(str(tmp_path / "out")).num_rows == 200


def test_a_scenario_that_lacks_a_client_is_one_sentence(tmp_path, capsys):
    drake_source(tmp_path / "src")
    scenario = tmp_path / "src" / "scenarios" / "DRAKE_hetero_llava_llama_1B_3B.json"
    scenario.write_text(json.dumps(json.loads(scenario.read_text())[:9]))
    assert main(["prepare", "drake", "--out", str(tmp_path / "drake"), "--source", str(tmp_path / "src")]) == 2
    err = capsys.readouterr().err.strip()
    assert "DRAKE_hetero_llava_llama_1B_3B.json does not list clients 0..9 once each" in err and "\n" not in err
    assert "https://raw.githubusercontent.com/snumprlab/fedmosaic/7887f5f" in err
