"""Build a benchmark's folders from its public files: ``rayfed prepare NAME``.

A preparer is a function of a :class:`PrepareRequest`, registered with ``rayfed.register_preparer(NAME)`` beside the
paper whose configs read what it writes. It finds the files it needs in the user's ``--source`` folders and archives
(:class:`SourceFiles`), downloads what is public and missing (:func:`hub_files`, :func:`url_file`, then
:meth:`SourceFiles.add`), checks them, says in one sentence what is missing and where to get it (``DataError``), and
writes ``save_to_disk`` folders (:func:`write_dataset`), one progress line a step (:meth:`PrepareRequest.step`).

Archives (zip, tar) are read in place, member by member, so that a benchmark needing a few thousand images of a
20 GB archive reads those alone; a member named by an absolute path or through ``..`` is refused.
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from rayfed import registry
from rayfed.data.sources.dataset import DataError

if TYPE_CHECKING:
    import datasets

ARCHIVES = (".zip", ".tar", ".tar.gz", ".tgz")
DOWNLOADS = ".downloads"  # under the output folder: files fetched by URL (the hub's go to its own cache)


@dataclass(frozen=True)
class Found:
    """One file of the sources: its path inside its root folder or archive, and where it lives."""

    parts: tuple[str, ...]
    container: Path  # the root folder, or the archive holding it
    member: str | None = None  # its name inside the archive; None for a plain file

    @property
    def name(self) -> str:
        """Where it is, as messages show it: ``folder/path`` or ``archive:member``."""
        if self.member is None:
            return str(self.container.joinpath(*self.parts))
        return f"{self.container}:{self.member}"


def check_member_name(archive: Path, member: str) -> None:
    """Refuse an archive member whose name is absolute or climbs out through ``..``."""
    path = PurePosixPath(member.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or (len(member) > 1 and member[1] == ":"):
        raise DataError(f"{archive} holds a member named {member!r}, which points outside the archive (an absolute "
                        "path or '..'); refusing to read it: download the archive again from its source.")


def _parts(path: str) -> tuple[str, ...]:
    return tuple(part for part in PurePosixPath(path.replace("\\", "/")).parts if part not in ("/", "."))


def _shared_tail(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    count = 0
    while count < min(len(a), len(b)) and a[-1 - count] == b[-1 - count]:
        count += 1
    return count


class SourceFiles:
    """Every file of some folders and archives (and of the zip and tar archives inside those folders), found by the
    end of its path: ``coco/train2017/1.jpg`` finds ``train2017/1.jpg`` of ``train2017.zip``."""

    def __init__(self, roots: Sequence[Path]) -> None:
        self.roots: list[Path] = []
        self._by_name: dict[str, list[Found]] = defaultdict(list)
        self._open: dict[Path, zipfile.ZipFile | tarfile.TarFile] = {}
        self._seen: set[Path] = set()  # files indexed, resolved: one reached twice (a link, a root again) counts once
        for root in roots:
            self.add(root)

    def add(self, root: Path) -> None:
        """Index the files of folder or file ``root`` too."""
        self.roots.append(root)
        if root.is_dir():
            for folder, _, names in os.walk(root, followlinks=True):
                for name in sorted(names):
                    self._add(Path(folder) / name, root)
        elif root.is_file():
            self._add(root, root.parent)
        else:
            raise DataError(f"--source {root} is neither a folder nor a file.")

    def _add(self, file: Path, root: Path) -> None:
        if file.resolve() in self._seen:
            return
        self._seen.add(file.resolve())
        if file.name.endswith(ARCHIVES):
            self._add_archive(file)
        else:
            found = Found(_parts(file.relative_to(root).as_posix()), root)
            self._by_name[found.parts[-1]].append(found)

    def _add_archive(self, archive: Path) -> None:
        try:
            if archive.name.endswith(".zip"):
                opened: zipfile.ZipFile | tarfile.TarFile = zipfile.ZipFile(archive)
                members = [info.filename for info in opened.infolist() if not info.is_dir()]
            else:
                opened = tarfile.open(archive)
                members = [info.name for info in opened.getmembers() if info.isfile()]
        except (OSError, zipfile.BadZipFile, tarfile.TarError) as err:
            raise DataError(f"{archive} cannot be read as an archive ({err}); download it again.") from None
        for member in members:
            check_member_name(archive, member)
        self._open[archive] = opened
        for member in members:
            found = Found(_parts(member), archive, member)
            self._by_name[found.parts[-1]].append(found)

    def find(self, path: str, near: Found | None = None, whole: bool = False) -> Found | None:
        """The file whose path ends with the most of ``path``'s parts (at least two, or all with ``whole``), preferring
        the root or archive of ``near``; None if there is none."""
        parts = _parts(path)
        candidates = self._by_name.get(parts[-1], []) if parts else []
        if near is not None:
            candidates = [c for c in candidates if c.container == near.container] or candidates
        scored = [(_shared_tail(c.parts, parts), c) for c in candidates]
        best = max((score for score, _ in scored), default=0)
        if best < (len(parts) if whole else min(2, len(parts))):
            return None
        winners = [c for score, c in scored if score == best]
        if len(winners) > 1:
            raise DataError(f"{path} matches {len(winners)} files of the sources ({winners[0].name} and "
                            f"{winners[1].name}); keep one of them.")
        return winners[0]

    def require(self, path: str, get_it: str, near: Found | None = None, whole: bool = False) -> Found:
        """:meth:`find`, or one sentence naming the missing file, where it was looked for and ``get_it``."""
        found = self.find(path, near, whole)
        if found is None:
            where = ", ".join(str(root) for root in self.roots) or "no --source"
            raise DataError(f"{path} is missing from {where}; {get_it}.")
        return found

    def read(self, found: Found) -> bytes:
        """The file's bytes (an archive member's read from the archive)."""
        if found.member is None:
            return (found.container / Path(*found.parts)).read_bytes()
        opened = self._open[found.container]
        if isinstance(opened, zipfile.ZipFile):
            return opened.read(found.member)
        member = opened.extractfile(found.member)
        assert member is not None  # indexed: a regular file
        return member.read()

    def read_json(self, found: Found, what: str) -> Any:
        """The file read as JSON, or one sentence saying it is not, then ``what`` to do."""
        try:
            return json.loads(self.read(found))
        except (ValueError, UnicodeDecodeError) as err:
            raise DataError(f"{found.name} is not JSON ({err}); {what}.") from None

    def image(self, found: Found) -> dict[str, Any]:
        """The image's encoded bytes as a ``datasets.Image`` value, once its header reads as an image."""
        from PIL import Image, UnidentifiedImageError

        data = self.read(found)
        try:
            Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError) as err:
            raise DataError(f"{found.name} is not an image ({err}); download its archive again.") from None
        return {"bytes": data, "path": found.parts[-1]}


@dataclass(frozen=True)
class PrepareRequest:
    """What ``rayfed prepare`` asks a preparer for: benchmark ``name``'s folders under ``out`` (None: where its
    configs read them), from the files of ``sources`` and downloads."""

    name: str
    out: Path | None = None
    sources: tuple[Path, ...] = ()

    def folder(self, default: str) -> Path:
        """The output folder: ``out``, else ``default`` (where the benchmark's configs read it)."""
        return self.out if self.out is not None else Path(default)

    def step(self, text: str) -> None:
        """One progress line."""
        print(f"{self.name}: {text}", flush=True)

    def files(self) -> SourceFiles:
        """The files of ``--source``."""
        return SourceFiles(self.sources)


def hub_files(repo: str, patterns: Sequence[str], get_it: str) -> list[Path]:
    """Hub dataset ``repo``'s files matching ``patterns`` (shell patterns of their paths), downloaded into the hub's
    cache."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id=repo, repo_type="dataset", allow_patterns=list(patterns)))
    except Exception as err:  # offline, gated, no such repository: all reported the same way
        raise DataError(f"{', '.join(patterns)} could not be downloaded from the hub dataset {repo} "
                        f"({type(err).__name__}); {get_it}.") from err
    files = (path for path in sorted(folder.rglob("*")) if path.is_file())
    return [path for path in files if any(fnmatch.fnmatch(path.relative_to(folder).as_posix(), p) for p in patterns)]


def url_file(url: str, folder: Path, get_it: str) -> Path:
    """``url``'s file in ``folder``, downloaded unless it is there already."""
    target = folder / url.rsplit("/", 1)[-1]
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, partial.open("wb") as file:
            shutil.copyfileobj(response, file)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise DataError(f"{url} could not be downloaded ({err}); {get_it}.") from None
    partial.replace(target)
    return target


def write_dataset(folder: Path, rows: Callable[[], Iterator[dict[str, Any]]], features: datasets.Features) -> None:
    """Write ``rows()`` as a ``save_to_disk`` folder that appears whole or not at all (a previous one is replaced);
    the rows are streamed to disk, never held together."""
    import datasets

    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # the preparer prints one line a folder
    try:
        written = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(work / "cache"),
                                                  fingerprint=work.name)
        written.save_to_disk(str(work / "dataset"))
        del written
        if folder.exists():
            folder.replace(work / "previous")
        (work / "dataset").replace(folder)
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
        shutil.rmtree(work, ignore_errors=True)


def prepare(name: str, out: str | None = None, sources: Sequence[str] = ()) -> None:
    """Run benchmark ``name``'s preparer (``rayfed prepare``)."""
    resolved = registry.resolve("preparer", name)
    request = PrepareRequest(resolved.name, Path(out) if out else None, tuple(Path(s).expanduser() for s in sources))
    resolved.obj(request)


def describe() -> list[tuple[str, str]]:
    """Each registered benchmark and the first sentence of its preparer's docstring."""
    return [(entry.name, entry.help) for entry in registry.entries("preparer")]
