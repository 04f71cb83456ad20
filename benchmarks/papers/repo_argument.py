"""The repository a paper script reads and writes: ``--repo PATH``, the checkout's root (default: the current
folder). The scripts never locate the checkout from their own path, so they run on any copy of it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def add_repo_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", type=Path, default=Path("."),
                        help="the rayfed repository's root, whose configs/ this reads or writes (default: the current "
                             "folder)")


def configs_of(repo: Path) -> Path:
    """``repo``'s ``configs/`` folder; one sentence when ``repo`` has none."""
    configs = Path(repo) / "configs"
    if not configs.is_dir():
        raise SystemExit(f"--repo {str(repo)!r} has no configs/ folder: pass the rayfed repository's root (default: "
                         "the current folder).")
    return configs


def run_generator(description: str, write: Callable[[Path], list[Path]], argv: list[str] | None = None) -> None:
    """A config generator's command line: ``write`` into the ``--repo`` given, then list the files it wrote."""
    parser = argparse.ArgumentParser(description=description)
    add_repo_argument(parser)
    repo = parser.parse_args(argv).repo
    for path in write(repo):
        print(path.relative_to(repo))
