"""``rayfed prepare feddat-domain``: FedDAT's Domain benchmark (docs/feddat.md#preparing-the-data) from the five
datasets' public releases, the folders ``configs/feddat/paper_domain.yaml`` reads; ``rayfed prepare clove`` says
why the Function and Scene benchmarks have none.

Each dataset's files are read from its own folder of ``--source`` (``vizwiz/``, ``cocoqa/``, ``aqua/``, ``gqa/``,
``vqa_abstract/``), as they are published (zip archives or their unpacked folders), none of them on the hub: the
images come from sites that ask for a manual download. As the authors' code (whose own processed files are not
public): a question's answer is its most frequent annotator answer, a client keeps the samples whose answer is among
its 100 most frequent training answers and draws 2,500 training and 500 test samples of them (seeded), from the
dataset's train and evaluation splits. Written: ``<out>/<dataset>``, columns ``image``, ``question``, ``answer``
(a ClassLabel over the 100 answers, most frequent first) and ``split`` (train, test).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rayfed.data.prepare import Found, PrepareRequest, SourceFiles, write_dataset
from rayfed.data.sources import DataError
from rayfed.registry import register_preparer

ANSWERS, TRAIN_SAMPLES, TEST_SAMPLES, SEED = 100, 2500, 500, 0


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    image: str  # the image's path (its end) in the dataset's files
    get_image: str  # where its images are published


Pools = tuple[list[Question], list[Question]]  # the train split's questions, the evaluation split's


def _most_frequent(answers: list[str]) -> str:
    return Counter(answers).most_common(1)[0][0]


def _json(files: SourceFiles, name: str, get_it: str) -> Any:
    return files.read_json(files.require(name, get_it), get_it)


def vizwiz(files: SourceFiles) -> Pools:
    """VizWiz-VQA: ``train.json`` and ``val.json`` (Annotations.zip), images in train.zip and val.zip."""
    get_it = "it is in https://vizwiz.cs.colorado.edu/VizWiz_final/vqa_data/Annotations.zip"
    train, val = ([Question(q["question"], _most_frequent([a["answer"] for a in q["answers"]]), q["image"],
                            f"https://vizwiz.cs.colorado.edu/VizWiz_final/images/{split}.zip")
                   for q in _json(files, f"{split}.json", get_it)] for split in ("train", "val"))
    return train, val


def cocoqa(files: SourceFiles) -> Pools:
    """COCO-QA: ``{train,test}/{questions,answers,img_ids}.txt`` (cocoqa-2015-05-17.zip); its train images are COCO
    train2014's, its test images COCO val2014's."""
    get_it = "it is in http://www.cs.toronto.edu/~mren/imageqa/data/cocoqa/cocoqa-2015-05-17.zip"
    pools = []
    for split, coco in (("train", "train2014"), ("test", "val2014")):
        columns = [files.read(files.require(f"{split}/{name}.txt", get_it)).decode().splitlines()
                   for name in ("questions", "answers", "img_ids")]
        if len({len(column) for column in columns}) != 1:
            raise DataError(f"COCO-QA's {split} files hold different numbers of lines; {get_it}.")
        pools.append([Question(q, a, f"COCO_{coco}_{int(i):012d}.jpg", f"http://images.cocodataset.org/zips/{coco}.zip")
                      for q, a, i in zip(*columns)])
    return pools[0], pools[1]


def aqua(files: SourceFiles) -> Pools:
    """AQUA: ``train.json`` and ``test.json`` (noagarcia/ArtVQA, folder AQUA), images SemArt's."""
    get_it = "it is in https://github.com/noagarcia/ArtVQA/tree/master/AQUA"
    train, test = ([Question(q["question"], q["answer"], q["image"], "SemArt, https://noagarcia.github.io/SemArt/")
                    for q in _json(files, f"{split}.json", get_it)] for split in ("train", "test"))
    return train, test


def gqa(files: SourceFiles) -> Pools:
    """GQA: ``train_balanced_questions.json`` and ``val_balanced_questions.json`` (questions1.2.zip), images in
    images.zip."""
    get_it = "it is in https://downloads.cs.stanford.edu/nlp/data/gqa/questions1.2.zip"
    images = "https://downloads.cs.stanford.edu/nlp/data/gqa/images.zip"
    train, val = ([Question(q["question"], q["answer"], f"{q['imageId']}.jpg", images)
                   for q in _json(files, f"{split}_balanced_questions.json", get_it).values()]
                  for split in ("train", "val"))
    return train, val


def vqa_abstract(files: SourceFiles) -> Pools:
    """VQA's abstract scenes (v002): the open-ended questions and the annotations of train2015 and val2015, images
    in scene_img_abstract_v002_{train,val}2015.zip."""
    site = "https://s3.amazonaws.com/cvmlp/vqa/abstract_v002"
    pools = []
    for split, zipped in (("train2015", "Train"), ("val2015", "Val")):
        questions = _json(files, f"OpenEnded_abstract_v002_{split}_questions.json",
                          f"it is in {site}/vqa/Questions_{zipped}_abstract_v002.zip")["questions"]
        annotations = _json(files, f"abstract_v002_{split}_annotations.json",
                            f"it is in {site}/vqa/Annotations_{zipped}_abstract_v002.zip")["annotations"]
        answer = {a["question_id"]: a["multiple_choice_answer"] for a in annotations}
        images = f"{site}/scene_img/scene_img_abstract_v002_{split}.zip"
        pools.append([Question(q["question"], answer[q["question_id"]],
                               f"abstract_v002_{split}_{q['image_id']:012d}.png", images)
                      for q in questions if q["question_id"] in answer])
    return pools[0], pools[1]


DOMAINS: dict[str, Callable[[SourceFiles], Pools]] = {
    "vizwiz": vizwiz, "cocoqa": cocoqa, "aqua": aqua, "gqa": gqa, "vqa_abstract": vqa_abstract}


def _draw(pool: list[Question], answers: set[str], count: int, stream: int) -> list[Question]:
    kept = [q for q in pool if q.answer in answers]
    rng = np.random.default_rng(np.random.SeedSequence([SEED, stream]))
    return [kept[i] for i in np.sort(rng.permutation(len(kept))[:count])]


def client_data(files: SourceFiles, domain: int, pools: Pools) -> tuple[list[str], list[tuple[Question, str, Found]]]:
    """The client's answer pool (most frequent first) and its drawn (question, split, image) rows, images found."""
    train, test = pools
    counts = Counter(q.answer for q in train)
    answers = [a for a, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:ANSWERS]]
    rows = []
    for index, (split, pool, count) in enumerate((("train", train, TRAIN_SAMPLES), ("test", test, TEST_SAMPLES))):
        for q in _draw(pool, set(answers), count, 2 * domain + index):
            rows.append((q, split, files.require(q.image, f"its images are in {q.get_image}; pass it with --source")))
    return answers, rows


def write_client(folder: Path, files: SourceFiles, answers: list[str], rows: list[tuple[Question, str, Found]]) -> None:
    import datasets

    features = datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                                  "answer": datasets.ClassLabel(names=answers), "split": datasets.Value("string")})

    def generate() -> Iterator[dict[str, Any]]:
        for q, split, found in rows:
            yield {"image": files.image(found), "question": q.question, "answer": answers.index(q.answer),
                   "split": split}

    write_dataset(folder, generate, features)


@register_preparer("feddat-domain")
def feddat_domain(request: PrepareRequest) -> None:
    """FedDAT's Domain clients (VizWiz, COCO-QA, AQUA, GQA, VQA abstract scenes) from their releases in --source, for
    configs/feddat/paper_domain.yaml (data/feddat)."""
    out = request.folder("data/feddat")
    if not request.sources:
        raise DataError(f"rayfed prepare feddat-domain reads the five datasets from --source DIR, one folder each "
                        f"({', '.join(DOMAINS)}); docs/feddat.md#preparing-the-data lists their files and where to "
                        "get them.")
    prepared = {}
    for index, (name, read) in enumerate(DOMAINS.items()):
        files = SourceFiles([root / name for root in request.sources if (root / name).is_dir()])
        if not files.roots:
            raise DataError(f"no --source folder has a {name}/ folder; docs/feddat.md#preparing-the-data lists its "
                            "files and where to get them.")
        try:
            pools = read(files)
        except DataError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise DataError(f"{name}'s files are not in the form of its release ({type(err).__name__}: {err}); "
                            "docs/feddat.md#preparing-the-data lists the files it reads.") from None
        prepared[name] = (files, *client_data(files, index, pools))
        splits = Counter(split for _, split, _ in prepared[name][2])
        request.step(f"{name}: {len(prepared[name][1])} answers, {splits['train']:,} train + {splits['test']:,} test "
                     f"samples (the paper: {ANSWERS}, {TRAIN_SAMPLES:,} + {TEST_SAMPLES})")
    for name, (files, answers, rows) in prepared.items():
        write_client(out / name, files, answers, rows)
        request.step(f"wrote {out / name}")


@register_preparer("clove")
def clove(request: PrepareRequest) -> None:
    """FedDAT's Function and Scene benchmarks (CLOVE): no public source in the form the paper used; says so."""
    raise DataError("FedDAT's CLOVE splits (configs/feddat/paper_function.yaml, paper_scene.yaml) have no public "
                    "source that rayfed prepare could check: FedDAT's README lists their download as 'TODO' and its "
                    "processed files are not released, so build data/feddat/clove_function/<function> and "
                    "clove_scene/<scene> yourself as docs/feddat.md#preparing-the-data describes.")
