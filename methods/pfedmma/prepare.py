"""``rayfed prepare domainnet`` and ``rayfed prepare office-caltech10``: pFedMMA's feature-shift datasets
(docs/pfedmma.md#preparing-domainnet-and-office-caltech10), the folders ``configs/pfedmma/domainnet.yaml`` and
``office_caltech10.yaml`` read.

The paper's subsets and splits are FedBN's (its code loads FedBN's files): for each domain, ``<domain>_train.pkl``
and ``<domain>_test.pkl`` list image paths and class names, in the hub dataset ``Jemary/FedBN_Dataset``
(``domainnet_dataset.zip``: the splits of DomainNet's 10 classes; ``office_caltech_10_dataset.zip``: Office-Caltech10's
splits and images). DomainNet's images are its per-domain zips, published on its site. The pickles are read with an
unpickler that builds numpy arrays and nothing else. Written: ``<out>``, one ``save_to_disk`` folder, columns
``image``, ``label`` (a ClassLabel with FedBN's class names), ``domain`` and ``split`` (FedBN's train, test).
"""

from __future__ import annotations

import importlib.util
import io
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rayfed.data.prepare import Found, PrepareRequest, SourceFiles, hub_files, write_dataset
from rayfed.data.sources import DataError
from rayfed.registry import register_preparer

FEDBN_REPO = "Jemary/FedBN_Dataset"
SPLITS = ("train", "test")


@dataclass(frozen=True)
class FeatureShift:
    archive: str  # FedBN's file on the hub
    domains: tuple[str, ...]
    classes: tuple[str, ...]  # FedBN's label order
    images: str  # where a domain's images are published ({domain} filled in)
    out: str
    paper: tuple[int, int]  # the paper's train and test samples


DOMAINNET = FeatureShift(
    "domainnet_dataset.zip", ("clipart", "infograph", "painting", "quickdraw", "real", "sketch"),
    ("bird", "feather", "headphones", "ice_cream", "teapot", "tiger", "whale", "windmill", "wine_glass", "zebra"),
    "http://csr.bu.edu/ftp/visda/2019/multi-source/{domain}.zip", "data/domainnet", (18278, 4573))
OFFICE_CALTECH10 = FeatureShift(
    "office_caltech_10_dataset.zip", ("amazon", "caltech", "dslr", "webcam"),
    ("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor", "mouse", "mug",
     "projector"),
    f"https://huggingface.co/datasets/{FEDBN_REPO} (office_caltech_10_dataset.zip)", "data/office_caltech10",
    (2025, 508))

_NUMPY_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
                  ("numpy", "ndarray"), ("numpy", "dtype")}


class _ArraysOnly(pickle.Unpickler):
    """Builds numpy arrays (and plain Python values) only: any other class a pickle names is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _NUMPY_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a numpy array")
        if module.startswith("numpy.core.") and importlib.util.find_spec("numpy._core") is not None:
            module = "numpy._core." + module.removeprefix("numpy.core.")  # numpy 2's place for numpy 1's pickles
        return super().find_class(module, name)


def read_split(files: SourceFiles, found: Found, bench: FeatureShift) -> list[tuple[str, str]]:
    """FedBN's split file: its (image path, class name) pairs, once it holds two equal-length lists of known classes."""
    fix = f"take {bench.archive} from https://huggingface.co/datasets/{FEDBN_REPO} again"
    try:
        paths, labels = _ArraysOnly(io.BytesIO(files.read(found))).load()
        pairs = [(str(path), str(label)) for path, label in zip(paths, labels, strict=True)]
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError) as err:
        raise DataError(f"{found.name} is not FedBN's split file (a pickle of image paths and class names: {err}); "
                        f"{fix}.") from None
    unknown = sorted({label for _, label in pairs} - set(bench.classes))
    if unknown:
        raise DataError(f"{found.name} names the class {unknown[0]!r}, not one of the {len(bench.classes)} "
                        f"({', '.join(bench.classes)}); {fix}.")
    return pairs


def build(request: PrepareRequest, bench: FeatureShift) -> None:
    import datasets

    out = request.folder(bench.out)
    names = [f"{domain}_{split}.pkl" for domain in bench.domains for split in SPLITS]
    files = request.files()
    if any(files.find(name) is None for name in names):
        request.step(f"downloading {bench.archive} from the hub dataset {FEDBN_REPO}")
        for path in hub_files(FEDBN_REPO, [bench.archive], "pass it with --source"):
            files.add(path)
    rows = []
    for domain in bench.domains:
        get_images = f"its images are in {bench.images.format(domain=domain)}; pass it with --source"
        for split in SPLITS:
            found = files.require(f"{domain}_{split}.pkl",
                                  f"it is in https://huggingface.co/datasets/{FEDBN_REPO} ({bench.archive})")
            pairs = read_split(files, found, bench)
            rows += [(files.require(path, get_images), bench.classes.index(label), domain, split)
                     for path, label in pairs]
        counts = [sum(row[2] == domain and row[3] == split for row in rows) for split in SPLITS]
        request.step(f"{domain}: {counts[0]:,} train + {counts[1]:,} test images")
    totals = [sum(row[3] == split for row in rows) for split in SPLITS]
    request.step(f"{totals[0]:,} train + {totals[1]:,} test images (the paper: {bench.paper[0]:,} + "
                 f"{bench.paper[1]:,}); writing {out}")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(bench.classes)),
                                  "domain": datasets.Value("string"), "split": datasets.Value("string")})

    def generate() -> Iterator[dict[str, Any]]:
        for found, label, domain, split in rows:
            yield {"image": files.image(found), "label": label, "domain": domain, "split": split}

    write_dataset(out, generate, features)
    request.step(f"done: {out}")


@register_preparer("domainnet")
def domainnet(request: PrepareRequest) -> None:
    """DomainNet's 10-class subset in FedBN's split (6 domains), for configs/pfedmma/domainnet.yaml
    (data/domainnet)."""
    build(request, DOMAINNET)


@register_preparer("office-caltech10")
def office_caltech10(request: PrepareRequest) -> None:
    """Office-Caltech10 in FedBN's split (4 domains), for configs/pfedmma/office_caltech10.yaml
    (data/office_caltech10)."""
    build(request, OFFICE_CALTECH10)
