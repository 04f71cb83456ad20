"""The distribution's packages, found rather than listed (everything else is in pyproject.toml): under each folder
pyproject.toml's ``package-dir`` maps, every folder reached through folders with an ``__init__.py``, so that a new
paper package under methods/ needs no edit here. setuptools' own ``find`` names packages by their folders, which would
install ``methods`` and ``actors`` as top-level packages."""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.config.pyprojecttoml import load_file

ROOT = Path(__file__).resolve().parent


def packages_below(name: str, folder: Path) -> list[str]:
    """``name`` and its subpackages, where ``folder`` (holding an ``__init__.py``) is package ``name``."""
    found = [name]
    for child in sorted(folder.iterdir()):
        if (child / "__init__.py").is_file():
            found += packages_below(f"{name}.{child.name}", child)
    return found


def packages() -> list[str]:
    """Every package of the distribution."""
    package_dir = load_file(ROOT / "pyproject.toml")["tool"]["setuptools"]["package-dir"]
    return [package for name, folder in package_dir.items() for package in packages_below(name, ROOT / folder)]


if __name__ == "__main__":  # as setuptools runs it
    setup(packages=packages())
