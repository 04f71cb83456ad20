"""The engine names no paper: no module under rayfed/ names a seed paper's method, model or task key, in its code,
docstrings or comments. (That no module under rayfed/ imports rayfed.methods, and no lower layer rayfed.actors, is
tests/test_plugins.py::test_the_package_has_no_import_cycle_and_lower_layers_import_no_method_or_actor.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The seed papers' methods and models.
PAPER_NAMES = ("TAP", "MoME", "FedMosaic", "RELA", "PQ-LoRA", "FedDAT", "pFedMMA", "MMA", "FedYolo")
# Keys only one paper uses: the task keys TAP's model routes by (docs/tap.md; the engine's own task kinds, such as
# text_generation, stay), the source of FedMosaic's configs (task-groups) and pFedMMA's base-to-novel split.
PAPER_KEYS = ("image_classification", "image_generation", "text_classification", "task-groups", "base_novel")


def _word(name: str) -> str:
    """``name`` as a pattern: its parts joined by '-', '_' or nothing (``pq_lora``, ``pqlora``)."""
    return "[-_]?".join(re.escape(part) for part in re.split(r"[-_]", name))


# Case-insensitive; a whole word: no letter or digit on either side ('_' and '.' separate, so module names count).
PAPER_WORD = re.compile(r"(?<![a-z0-9])(" + "|".join(map(_word, PAPER_NAMES + PAPER_KEYS)) + r")(?![a-z0-9])",
                        re.IGNORECASE)


def _paper_words(root: Path = ROOT) -> dict[str, list[str]]:
    """Per module under ``root``/rayfed (path relative to ``root``): the paper names and keys it holds, in order."""
    found = {}
    for file in sorted((root / "rayfed").rglob("*.py")):
        words = [match.group() for match in PAPER_WORD.finditer(file.read_text())]
        if words:
            found[file.relative_to(root).as_posix()] = words
    return found


def test_no_engine_module_names_a_seed_paper():
    found = {name: sorted(set(words)) for name, words in _paper_words().items()}
    assert not found, (f"the engine names no paper (say what the piece does; the paper's docs/<paper>.md cite it, and "
                       f"its package registers what only it needs): {found}")


def test_the_paper_check_finds_names_and_keys_in_code_docstrings_and_comments(tmp_path):
    """The check above is not vacuous: a paper's name in a docstring, a comment, a module path and a string is found in
    any case and spelling of its parts, and words that merely contain one (tapering, dilemma, text_generation) are
    not."""
    engine = tmp_path / "rayfed"
    (engine / "models").mkdir(parents=True)
    (engine / "a.py").write_text('"""Like FedDAT\'s adapter."""\nfrom rayfed.pqlora import attach  # PQ-LoRA\n')
    (engine / "models" / "b.py").write_text('KEY = "image_generation"\nsource = "task-groups:vqa"\nmodel = "mome"\n')
    (engine / "c.py").write_text('"""Tapering steps; the dilemma of relations; text_generation; fedmosaics."""\n')
    assert _paper_words(tmp_path) == {"rayfed/a.py": ["FedDAT", "pqlora", "PQ-LoRA"],
                                      "rayfed/models/b.py": ["image_generation", "task-groups", "mome"]}


def test_setup_finds_every_package_so_a_built_wheel_holds_all_the_code():
    """setuptools installs the packages setup.py finds: every folder with an ``__init__.py`` below the folders
    pyproject.toml maps, a new paper's package included (rayfed.simulation was once missing from a hand-kept list);
    benchmarks/flower, a separate project, and benchmarks/papers, the repository's scripts, stay out."""
    import importlib.util
    import tomllib

    spec = importlib.util.spec_from_file_location("rayfed_setup", ROOT / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "flower" not in parts:  # benchmarks/flower is a separate project, installed on its own
                found.add(".".join((name, *parts)))
    packages = setup.packages()
    assert sorted(packages) == sorted(found) and len(packages) == len(set(packages))
    assert {"rayfed.methods.tap", "rayfed.actors", "rayfed.zoo"} <= found
    assert not [package for package in packages if "papers" in package or "flower" in package]
