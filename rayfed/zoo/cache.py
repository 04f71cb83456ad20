"""Build each pretrained tiny model once and keep it in the cache folder.

Layout: ``$RAYFED_CACHE/pretrained/<family>-<recipe hash>/`` holds the model in its family's own format
and ``manifest.json``; ``rayfed/zoo/weights/<family>-<recipe hash>/`` (:data:`PACKAGED`) holds the folders
that ship with rayfed, used when the cache has none for that recipe. A build writes into a temporary
folder renamed into place when complete, under a file lock, so parallel processes (Ray actors) build a
model once and never see half a model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import multiprocessing
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import filelock
import safetensors
import torch

from rayfed.data import multimodal
from rayfed.errors import ConfigError, choice_error, suggest
from rayfed.zoo.families import FAMILIES
from rayfed.zoo.registry import Family
from rayfed.zoo.training import deterministic_cpu

MANIFEST = "manifest.json"
PACKAGED = Path(__file__).parent / "weights"  # built folders shipped with rayfed (float16; see ship())
log = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$RAYFED_CACHE``, else ``~/.cache/rayfed``."""
    return Path(os.environ.get("RAYFED_CACHE") or Path.home() / ".cache" / "rayfed").expanduser()


def family(name: str) -> Family:
    """The registered family ``name``; a clear error with a close match if there is none."""
    if name not in FAMILIES:
        raise choice_error("family", name, FAMILIES)
    return FAMILIES[name]


def recipe(name: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The family's recipe with ``overrides`` merged in (nested keys must exist in the recipe)."""
    merged = copy.deepcopy(dict(family(name).recipe))
    _merge(merged, overrides or {}, f"{name} recipe")
    return merged


def _merge(into: dict[str, Any], overrides: Mapping[str, Any], where: str) -> None:
    for key, value in overrides.items():
        if key not in into:
            raise ConfigError(f"{where} has no key {key!r}{suggest(key, into)}; its keys are: {', '.join(into)}.")
        if isinstance(into[key], dict):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}.{key} = {value!r} must be a mapping of {', '.join(into[key])}.")
            _merge(into[key], value, f"{where}.{key}")
        else:
            into[key] = value


def recipe_hash(name: str, overrides: Mapping[str, Any] | None = None) -> str:
    """12 hex digits of SHA-256 over the family, its recipe, the data generators' version and the hashes
    of the families it starts from."""
    spec = {
        "family": name,
        "recipe": recipe(name, overrides),
        "data_version": multimodal.VERSION,
        "requires": {dep: recipe_hash(dep) for dep in family(name).requires},
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def pretrained(name: str, overrides: Mapping[str, Any] | None = None) -> Path:
    """The folder of the pretrained tiny model of family ``name``: the cache's, else the one shipped with
    rayfed for this recipe, else built on first use.

    ``overrides`` change the recipe (e.g. ``{"model": {"num_hidden_layers": 12}}``) and give a separate
    cache entry; the families this one starts from keep their default recipes.
    """
    digest = recipe_hash(name, overrides)
    folder = cache_root() / "pretrained" / f"{name}-{digest}"
    if not folder.is_dir() and (PACKAGED / folder.name).is_dir():
        folder = PACKAGED / folder.name
    if not folder.is_dir():
        if family(name).needs_gpu and not torch.cuda.is_available():
            log.warning("building tiny-pretrained:%s without a GPU (its default recipe takes hours on a CPU)", name)
        dependencies = {dep: pretrained(dep) for dep in family(name).requires}
        folder.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(folder.with_name(f"{folder.name}.lock")):
            if not folder.is_dir():  # another process may have built it while we waited
                _build(name, recipe(name, overrides), digest, folder, dependencies)
    read_manifest(folder)
    return folder


def shipped(name: str) -> bool:
    """Whether rayfed ships the built folder of family ``name``'s default recipe."""
    return (PACKAGED / f"{name}-{recipe_hash(name)}").is_dir()


def ship(name: str) -> Path:
    """Put the built folder of family ``name``'s default recipe (built first if the cache has none) into
    :data:`PACKAGED`, replacing the shipped folder of an older recipe; returns the shipped folder.

    What ships is the build itself, float16 tensors included (every build but open_clip's saves them,
    and every loader reads them back as float32), so the shipped manifest's metrics are the folder's own.
    Run it after changing a shipped family's recipe (``tests/test_zoo.py`` fails until then).
    """
    folder = pretrained(name)
    target = PACKAGED / folder.name
    if folder == target:
        return target
    not_half = [
        f"{path.name}:{key}"
        for path in sorted(folder.glob("*.safetensors"))
        for key, dtype in safetensors_dtypes(path).items()
        if dtype.is_floating_point and dtype != torch.float16
    ]
    if not_half:
        raise ConfigError(f"{folder} holds tensors that are not float16 ({', '.join(not_half[:3])}, ...); not shipped.")
    for stale in PACKAGED.glob(f"{name}-*"):
        if re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{12}}", stale.name):
            shutil.rmtree(stale)
    scratch = PACKAGED / f".{folder.name}.copying"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(folder, scratch)
    for path in scratch.iterdir():
        path.chmod(0o644)  # safetensors writes its files readable by their owner only
    os.replace(scratch, target)
    return target


def safetensors_dtypes(path: Path) -> dict[str, torch.dtype]:
    """The dtype of each tensor in a safetensors file."""
    with safetensors.safe_open(str(path), "pt") as weights:
        return {key: weights.get_tensor(key).dtype for key in weights.keys()}


def default_families() -> list[str]:
    """Every family but those that need a GPU to build and do not ship with rayfed."""
    return [name for name, spec in FAMILIES.items() if not spec.needs_gpu or shipped(name)]


def build_all(names: Sequence[str] | None = None, processes: int = 1) -> Iterator[tuple[str, Path]]:
    """(family, folder) of :func:`pretrained` for each family in ``names`` (default: :func:`default_families`),
    as each is ready.

    Each build runs on one thread, so ``processes`` worker processes build that many families at once on
    as many cores; the file locks make a worker that needs a family another one is building wait for it.
    """
    names = default_families() if names is None else list(names)
    for name in names:
        family(name)
    if processes <= 1:
        yield from ((name, pretrained(name)) for name in names)
        return
    # Families that start from others go last, so that workers rarely wait on each other's locks.
    ordered = sorted(names, key=lambda name: bool(family(name).requires))
    with multiprocessing.get_context("spawn").Pool(min(processes, len(names))) as pool:
        yield from zip(ordered, pool.imap(pretrained, ordered, chunksize=1))


def _build(name: str, full_recipe: dict[str, Any], digest: str, folder: Path, dependencies: Mapping[str, Path]) -> None:
    spec = family(name)
    scratch = folder.with_name(f".{folder.name}.building")  # only the lock's holder writes here
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    log.info("building tiny-pretrained:%s in %s", name, folder)
    wall, cpu = time.perf_counter(), time.process_time()
    with deterministic_cpu(full_recipe["seed"]):
        report = spec.build(scratch, full_recipe, dependencies)
    manifest = {
        "family": name,
        "stands_in_for": spec.stands_in_for,
        "objective": spec.objective,
        "recipe_hash": digest,
        "recipe": full_recipe,
        "seed": full_recipe["seed"],
        "requires": {dep: path.name for dep, path in dependencies.items()},
        "params": report.params,
        "metrics": {"before": report.before, "after": report.after},
        "build_seconds": round(time.perf_counter() - wall, 2),
        "build_cpu_seconds": round(time.process_time() - cpu, 2),
        "versions": _versions(),
    }
    (scratch / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(scratch, folder)


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {package: version(package) for package in ("rayfed", "torch", "transformers", "open_clip_torch")}


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a built model folder; a clear error if it is missing or not valid JSON."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"pretrained model cache file {path} is unreadable ({type(err).__name__}: {err}); "
            f"delete {path.parent} to rebuild it."
        ) from None
    if not isinstance(manifest, dict) or "metrics" not in manifest:
        raise ConfigError(
            f"pretrained model cache file {path} is not a rayfed manifest; delete {path.parent} to rebuild it."
        )
    return manifest


def evaluate(name: str, folder: Path) -> dict[str, float]:
    """The family's held-out metrics of the model saved in ``folder``, loaded through its real loader."""
    full_recipe = read_manifest(folder)["recipe"]
    with deterministic_cpu(full_recipe["seed"]):
        return family(name).evaluate(Path(folder), full_recipe)
