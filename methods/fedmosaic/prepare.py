"""``rayfed prepare drake`` and ``rayfed prepare hflb``: FedMosaic's benchmarks from their public files
(docs/fedmosaic.md#preparing-drake-and-hflb), the folders ``configs/fedmosaic/paper_*.yaml`` read through
``$DRAKE_ROOT`` / ``$HFLB_ROOT``.

Sources: the hub datasets ``SNUMPR/DRAKE`` and ``SNUMPR/HFLB`` (one ``<dataset>.tar`` a dataset, holding its images
and its LLaVA-style task splits ``<dataset>/train/dataset-<k>.json`` and ``<dataset>/test/dataset-<k>.json``), the
official repository's scenario file (which client holds which ``(dataset, k)`` in which order, and on which model),
and LLaVA-v1.5's instruction mixture for the public data. Written under the output folder:

- ``client<c>/task<t>``: client c's t-th task of the scenario, columns ``question`` (the sample's first user turn,
  ``<image>`` placeholders kept where the authors' prompts have them: their processor puts each image there),
  ``answer`` (the reply), ``image`` (one image; a list of images in every row of a task that has a multi-image
  sample) and ``split`` (``train`` or ``test``: the authors' own files, which ``partition: {name: presplit}`` keeps);
- ``public_llava_instruct_5k``: 5,000 image samples of ``llava_v1_5_mix665k.json`` drawn with a fixed seed (the
  authors' public data is the first 5,000 of a shuffle of that mixture), first turn only, same columns but ``split``;
- ``scenario.json``: the scenario used, with each task's sample counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rayfed.data.prepare import DOWNLOADS, Found, PrepareRequest, SourceFiles, hub_files, url_file, write_dataset
from rayfed.data.sources import DataError
from rayfed.registry import register_preparer

SCENARIO_COMMIT = "7887f5fab899534e3833e596dacf305b7f04bddf"  # snumprlab/fedmosaic, the official repository
SCENARIO_URL = f"https://raw.githubusercontent.com/snumprlab/fedmosaic/{SCENARIO_COMMIT}/scenarios/{{}}.json"
TASKS_PER_CLIENT = 4


@dataclass(frozen=True)
class Benchmark:
    repo: str  # the hub dataset holding one <dataset>.tar a dataset
    scenario: str  # scenarios/<scenario>.json of the official repository: Tab. 2 / 3's clients and models
    clients: int
    out: str  # the default output folder
    variable: str  # the environment variable the paper configs read it through


BENCHMARKS = {"drake": Benchmark("SNUMPR/DRAKE", "DRAKE_hetero_llava_llama_1B_3B", 10, "data/drake", "DRAKE_ROOT"),
              "hflb": Benchmark("SNUMPR/HFLB", "HFLB_hetero_llava_llama_1B_3B", 9, "data/hflb", "HFLB_ROOT")}

PUBLIC_FOLDER = "public_llava_instruct_5k"
PUBLIC_REPO, PUBLIC_JSON = "liuhaotian/LLaVA-Instruct-150K", "llava_v1_5_mix665k.json"
PUBLIC_SAMPLES, PUBLIC_SEED = 5000, 0
# The mixture's image folders (the first part of its paths) and where each is published.
PUBLIC_IMAGES = {
    "coco": "http://images.cocodataset.org/zips/train2017.zip",
    "gqa": "https://downloads.cs.stanford.edu/nlp/data/gqa/images.zip",
    "ocr_vqa": "https://huggingface.co/datasets/SNUMPR/DRAKE (llava_ft/ocr_vqa.tar)",
    "textvqa": "https://dl.fbaipublicfiles.com/textvqa/images/train_val_images.zip",
    "vg": "https://cs.stanford.edu/people/rak248/VG_100K_2/images.zip and images2.zip",
}
OCR_VQA_ARCHIVE = "llava_ft/ocr_vqa.tar"


@dataclass(frozen=True)
class Sample:
    question: str
    answer: str
    images: tuple[Found, ...]
    split: str


def _task(entry: Any, where: str) -> tuple[str, int, dict[str, Any]]:
    dataset, k = (entry.get("dataset"), entry.get("subset_id")) if isinstance(entry, dict) else (None, None)
    if not isinstance(dataset, str) or not isinstance(k, int):
        raise DataError(f"{where} is not a task of the form {{'dataset': name, 'subset_id': k, 'type': ...}}; take the "
                        f"scenario file from {SCENARIO_URL.format('<name>')}.")
    return dataset, k, {key: value for key, value in entry.items() if key not in ("dataset", "subset_id")}


def read_scenario(data: Any, bench: Benchmark, name: str) -> list[dict[str, Any]]:
    """The scenario's clients in id order, each ``{"client", "model", "tasks": [(dataset, k, extra), ...]}``, once it
    holds ``bench.clients`` clients of ``TASKS_PER_CLIENT`` tasks each."""
    listed = isinstance(data, list) and all(isinstance(client, dict) for client in data)
    ids = [client.get("client_id") for client in data] if listed else []
    if len(ids) != bench.clients or sorted(i for i in ids if isinstance(i, int)) != list(range(bench.clients)):
        raise DataError(f"{name} does not list clients 0..{bench.clients - 1} once each (client_id, datasets, "
                        f"model_id); take it from {SCENARIO_URL.format(bench.scenario)}.")
    clients = []
    for client in sorted(data, key=lambda c: c["client_id"]):
        tasks = client.get("datasets")
        if not isinstance(tasks, list) or len(tasks) != TASKS_PER_CLIENT:
            held = len(tasks) if isinstance(tasks, list) else 0
            raise DataError(f"{name}: client {client['client_id']} holds {held} tasks, not {TASKS_PER_CLIENT}; take it "
                            f"from {SCENARIO_URL.format(bench.scenario)}.")
        clients.append({"client": client["client_id"], "model": client.get("model_id"),
                        "tasks": [_task(task, f"{name}: client {client['client_id']}'s task {t}")
                                  for t, task in enumerate(tasks)]})
    return clients


def parse_sample(files: SourceFiles, sample: Any, where: str, split: str, fix: str, near: Found | None = None,
                 image_fix: str | None = None) -> Sample:
    """One LLaVA-style sample (an ``image`` path or list of paths, and ``conversations`` whose first two turns are the
    question and its answer), its images found in ``files`` (preferring ``near``'s archive or folder)."""
    turns = sample.get("conversations") if isinstance(sample, dict) else None
    paths = sample.get("image") if isinstance(sample, dict) else None
    paths = [paths] if isinstance(paths, str) else paths
    if (not isinstance(turns, list) or len(turns) < 2
            or not all(isinstance(turn, dict) and isinstance(turn.get("value"), str) for turn in turns[:2])
            or not isinstance(paths, list) or not paths or not all(isinstance(path, str) for path in paths)):
        raise DataError(f"{where} is not a LLaVA-style sample (an 'image' path or list of paths, and 'conversations' "
                        f"holding a question and its answer); {fix}.")
    images = tuple(files.require(path, image_fix or fix, near=near) for path in paths)
    return Sample(turns[0]["value"], turns[1]["value"], images, split)


def read_samples(files: SourceFiles, found: Found, split: str, fix: str) -> list[Sample]:
    """The samples of one task split's JSON file, each image found beside it; one sentence on the first fault."""
    data = files.read_json(found, fix)
    if not isinstance(data, list) or not data:
        raise DataError(f"{found.name} holds no list of samples; {fix}.")
    return [parse_sample(files, sample, f"{found.name}: sample {index}", split, fix, near=found)
            for index, sample in enumerate(data)]


def _features(multi_image: bool, with_split: bool) -> Any:
    import datasets

    image = datasets.Sequence(datasets.Image()) if multi_image else datasets.Image()
    columns = {"question": datasets.Value("string"), "answer": datasets.Value("string"), "image": image}
    return datasets.Features({**columns, **({"split": datasets.Value("string")} if with_split else {})})


def write_samples(folder: Path, files: SourceFiles, samples: list[Sample], with_split: bool = True) -> bool:
    """``samples`` as a save_to_disk folder; whether its ``image`` column holds lists (a multi-image sample)."""
    multi_image = any(len(sample.images) > 1 for sample in samples)

    def rows() -> Iterator[dict[str, Any]]:
        for sample in samples:
            images = [files.image(found) for found in sample.images]
            row = {"question": sample.question, "answer": sample.answer, "image": images if multi_image else images[0]}
            yield {**row, "split": sample.split} if with_split else row

    write_dataset(folder, rows, _features(multi_image, with_split))
    return multi_image


def _scenario(request: PrepareRequest, bench: Benchmark, files: SourceFiles, out: Path) -> tuple[Any, str]:
    name = f"{bench.scenario}.json"
    found = files.find(name)
    url = SCENARIO_URL.format(bench.scenario)
    if found is None:
        request.step(f"downloading {url}")
        files.add(url_file(url, out / DOWNLOADS, "download it yourself and pass it with --source"))
        found = files.require(name, f"take it from {url}")
    return files.read_json(found, f"take it from {url}"), found.name


def _download_tasks(request: PrepareRequest, bench: Benchmark, files: SourceFiles, tasks: set[tuple[str, int]]) -> None:
    """Add to ``files`` the hub's archives of the datasets they lack."""
    lacking = sorted({dataset for dataset, k in tasks
                      if files.find(f"{dataset}/train/dataset-{k}.json", whole=True) is None})
    if not lacking:
        return
    request.step(f"downloading {', '.join(f'{d}.tar' for d in lacking)} from the hub dataset {bench.repo}")
    get_it = (f"download them from https://huggingface.co/datasets/{bench.repo} (one <dataset>.tar each) and pass "
              "their folder with --source")
    for path in hub_files(bench.repo, [p for d in lacking for p in (f"{d}.tar", f"{d}/*")], get_it):
        files.add(path)


def task_samples(request: PrepareRequest, bench: Benchmark, files: SourceFiles, clients: list[dict[str, Any]]
                 ) -> dict[tuple[int, int], list[Sample]]:
    """Every task's samples (train, then test), each file and image found before anything is written."""
    _download_tasks(request, bench, files, {task[:2] for client in clients for task in client["tasks"]})
    tasks = {}
    for client in clients:
        for t, (dataset, k, _) in enumerate(client["tasks"]):
            fix = (f"take {dataset}.tar from https://huggingface.co/datasets/{bench.repo} again and pass its folder "
                   "with --source")
            tasks[client["client"], t] = [sample for split in ("train", "test") for sample in read_samples(
                files, files.require(f"{dataset}/{split}/dataset-{k}.json", fix, whole=True), split, fix)]
    return tasks


def public_samples(request: PrepareRequest, files: SourceFiles) -> list[Sample]:
    """D_p: ``PUBLIC_SAMPLES`` image samples of LLaVA-v1.5's mixture drawn with ``PUBLIC_SEED``, images found."""
    get_it = f"take it from https://huggingface.co/datasets/{PUBLIC_REPO} and pass it with --source"
    if files.find(PUBLIC_JSON) is None:
        request.step(f"downloading {PUBLIC_JSON} from the hub dataset {PUBLIC_REPO}")
        for path in hub_files(PUBLIC_REPO, [PUBLIC_JSON], get_it):
            files.add(path)
    found = files.require(PUBLIC_JSON, get_it)
    mixture = files.read_json(found, get_it)
    if not isinstance(mixture, list):
        raise DataError(f"{found.name} holds no list of samples; {get_it}.")
    with_image = [sample for sample in mixture if isinstance(sample, dict) and "image" in sample]
    chosen = [with_image[i] for i in np.random.default_rng(PUBLIC_SEED).permutation(len(with_image))[:PUBLIC_SAMPLES]]
    ocr_vqa = [sample["image"] for sample in chosen if str(sample["image"]).startswith("ocr_vqa/")]
    if any(files.find(str(path)) is None for path in ocr_vqa):
        request.step(f"downloading {OCR_VQA_ARCHIVE} from the hub dataset {BENCHMARKS['drake'].repo}")
        for path in hub_files(BENCHMARKS["drake"].repo, [OCR_VQA_ARCHIVE], "pass it with --source"):
            files.add(path)
    samples = []
    for index, sample in enumerate(chosen):
        folder = str(sample.get("image")).split("/")[0]
        where = PUBLIC_IMAGES.get(folder, "the LLaVA-v1.5 instruction data's image sources")
        image_fix = f"its images are at {where}; pass that archive or its folder with --source"
        samples.append(parse_sample(files, sample, f"{PUBLIC_JSON}: sample {sample.get('id', index)}", "", get_it,
                                    image_fix=image_fix))
    return samples


def build(request: PrepareRequest, bench: Benchmark) -> None:
    out = request.folder(bench.out)
    files = request.files()
    data, name = _scenario(request, bench, files, out)
    clients = read_scenario(data, bench, name)
    request.step(f"scenario {bench.scenario}: {len(clients)} clients, {TASKS_PER_CLIENT} tasks each")
    tasks = task_samples(request, bench, files, clients)
    public = public_samples(request, files)
    request.step(f"every file found; writing {out}")
    for client in clients:
        for t, (dataset, k, extra) in enumerate(client["tasks"]):
            samples = tasks[client["client"], t]
            counts = {split: sum(sample.split == split for sample in samples) for split in ("train", "test")}
            multi = write_samples(out / f"client{client['client']}" / f"task{t}", files, samples)
            extra.update(dataset=dataset, subset_id=k, **counts, multi_image=multi)
            request.step(f"client{client['client']}/task{t} ({dataset} {k}): {counts['train']:,} train + "
                         f"{counts['test']:,} test samples{', multi-image' if multi else ''}")
    write_samples(out / PUBLIC_FOLDER, files, public, with_split=False)
    request.step(f"{PUBLIC_FOLDER}: {len(public):,} samples")
    manifest = {"scenario": bench.scenario, "commit": SCENARIO_COMMIT, "clients": [
        {"client": c["client"], "model": c["model"], "tasks": [extra for _, _, extra in c["tasks"]]} for c in clients]}
    (out / "scenario.json").write_text(json.dumps(manifest, indent=1) + "\n")
    request.step(f"done; the paper configs read it with: export {bench.variable}={out}")


@register_preparer("drake")
def drake(request: PrepareRequest) -> None:
    """DRAKE (SNUMPR/DRAKE, scenario DRAKE_hetero_llava_llama_1B_3B): 10 clients x 4 tasks and the public data, for
    configs/fedmosaic/paper_drake_*.yaml ($DRAKE_ROOT)."""
    build(request, BENCHMARKS["drake"])


@register_preparer("hflb")
def hflb(request: PrepareRequest) -> None:
    """HFLB (SNUMPR/HFLB, scenario HFLB_hetero_llava_llama_1B_3B): 9 clients x 4 tasks and the public data, for
    configs/fedmosaic/paper_hflb_dynamic.yaml ($HFLB_ROOT)."""
    build(request, BENCHMARKS["hflb"])
