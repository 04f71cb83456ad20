"""docs/architecture.md names only what exists (files, tests, modules, attributes, registered plug-ins), lists every
hook of ``Method``, states the import rules as tests/test_plugins.py enforces them, and its layer table holds for
every import of the package."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

from rayfed import registry
from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.method import Method
from rayfed.simulation import Simulation
from rayfed.training import ClientContext

from test_plugins import LOWER_LAYERS, ROOT, _imports, _modules

DOC = ROOT / "docs" / "architecture.md"
TEXT = DOC.read_text()
CLASSES = {cls.__name__: cls for cls in (Method, ClientActor, DriverActor, Simulation, ClientContext)}
PATH = re.compile(r"(?<![\w./])((?:rayfed|actors|methods|benchmarks|configs|examples|docs|tests|cluster)/[\w./<>:-]*)")


def _section(heading: str) -> str:
    """The text under the ``## `` heading that starts with ``heading``, up to the next one."""
    [section] = [part for part in TEXT.split("\n## ") if part.startswith(heading)]
    return section


def _spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _table(section: str) -> list[list[list[str]]]:
    """Each row of the section's table (header and rule left out) as its cells' code spans."""
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[_spans(cell) for cell in row.strip("|").split(" | ")] for row in rows]


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the package, or an attribute of one (modules are found, not run)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:end]))
        except ModuleNotFoundError:  # a parent that is a module, not a package
            spec = None
        if spec is None:
            continue
        if end == len(parts):
            return True
        target = importlib.import_module(".".join(parts[:end]))
        for part in parts[end:]:
            if not hasattr(target, part):
                return False
            target = getattr(target, part)
        return True
    return False


def test_every_file_and_test_the_page_names_exists_and_the_readme_links_it():
    for path in {match.rstrip(".,:") for match in PATH.findall(TEXT)}:
        path, _, test = path.partition("::")
        if "<" in path:  # a pattern (methods/<name>.py): its folder exists
            path = path[:path.index("<")].rpartition("/")[0]
        assert (ROOT / path).exists(), path
        if test:
            assert f"\ndef {test}(" in (ROOT / path).read_text(), f"{path} has no {test}"
    for link in re.findall(r"\]\(([^)#]+)", TEXT):
        assert (DOC.parent / link).exists(), link
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()


def test_every_module_class_and_attribute_the_page_names_exists():
    for span in _spans(TEXT):
        if re.fullmatch(r"rayfed(\.\w+)*", span):
            assert _resolves(span), span
        elif (owner := span.partition(".")[0]) in CLASSES and re.fullmatch(r"\w+\.\w+", span):
            assert hasattr(CLASSES[owner], span.partition(".")[2]), span


def test_the_hook_table_lists_every_hook_of_method_and_only_those():
    listed = {name for row in _table(_section("Where a method's hooks run")) for name in row[0]}
    hooks = {name for name, value in vars(Method).items()
             if callable(value) and not isinstance(value, type) and not name.startswith("_")}
    assert listed == hooks


def test_the_plug_in_table_covers_every_kind_with_its_decorator_and_registered_names():
    kinds = set()
    for kind_cell, decorator, _, names, *_ in _table(_section("Where to add things")):
        [kind] = kind_cell
        kinds.add(kind)
        assert decorator == [f"rayfed.register_{kind}"], kind
        registered = [entry.obj for entry in registry.entries(kind)]
        for name in names:
            assert any(registry.resolve(kind, name).obj is obj for obj in registered), f"{kind} {name!r}"
    assert kinds == set(registry.KINDS)


def test_the_import_rules_are_the_ones_tests_test_plugins_enforces():
    section = _section("Import rules")
    lower = section[section.index("- the lower layers"):].split("\n- ")[0]
    assert set(_spans(lower)) - {"rayfed.methods", "rayfed.actors"} == set(LOWER_LAYERS)
    assert "- no module reaches itself through imports, type-hint imports included." in section


def test_every_module_imports_only_its_own_layer_or_those_below():
    """The layer table, top to bottom, covers every module; type-hint imports count."""
    rows = [cells[1] for cells in _table(_section("The layers"))]

    def row_of(module: str) -> int:
        matches = [(len(prefix), index) for index, prefixes in enumerate(rows) for prefix in prefixes
                   if module == prefix or module.startswith(prefix + ".")]
        assert matches, f"{module} is in no row of the layer table"
        return max(matches)[1]

    modules = _modules()
    for module, file in modules.items():
        for target in _imports(module, file, modules):
            assert row_of(target) >= row_of(module), f"{module} imports {target}, a layer above it"


# Citations a reader can follow ----------------------------------------------------------------------------------
# A paper is cited by its title and arXiv id, a section of ours as docs/<page>.md#<anchor> (GitHub's anchor of one of
# the page's headings); the project's notes (seed files by hash, spec files and their sections) are not in the
# repository. Pages in docs/ link each other as [text](<page>.md#<anchor>) or [text](#<anchor>).
CITED_FOLDERS = ("rayfed", "actors", "methods", "benchmarks", "configs", "examples", "tests", "docs", "cluster")
SEED_FILE = re.compile(r"\b\d{3}_[0-9a-f]{16}\b")
SPEC_FILE = re.compile(r"\bspecs/[\w-]+\.md|\bspec\b\W{1,6}[\w-]+\.md", re.IGNORECASE)
SPEC_SECTION = re.compile(r"\bspec(?:'s)?\b[^\n§.;]{0,40}§", re.IGNORECASE)
DOC_ANCHOR = re.compile(r"\bdocs/([\w-]+\.md)#([\w-]+)")
PAGE_LINK = re.compile(r"\]\(([\w-]+\.md)?#([\w-]+)\)")

# Work left for issue 36: files that other parts of the issue are rewriting and that still cite the notes. A file
# that no longer does fails the test until it is dropped from here, so the list only shrinks.
CLOSED_CITATIONS_LEFT: set[str] = set()


def _cited_files(root: Path) -> list[Path]:
    files = [root / "README.md", root / "pyproject.toml"]
    for folder in CITED_FOLDERS:
        files += [f for f in sorted((root / folder).rglob("*")) if f.suffix in {".py", ".md", ".yaml", ".yml"}]
    return [f for f in files if f.is_file() and f.resolve() != Path(__file__).resolve()]  # its examples cite on purpose


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings (outside code blocks): lower case, punctuation dropped, spaces as -."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _citation_problems(root: Path) -> dict[str, list[str]]:
    """Per file (relative path): each closed citation and each link to a heading that does not exist."""
    problems: dict[str, list[str]] = {}
    for file in _cited_files(root):
        name, text = file.relative_to(root).as_posix(), file.read_text()
        found = [m.group() for pattern in (SEED_FILE, SPEC_FILE, SPEC_SECTION) for m in pattern.finditer(text)]
        links = [(root / "docs" / page, anchor) for page, anchor in DOC_ANCHOR.findall(text)]
        if name.startswith("docs/"):
            links += [(file.parent / page if page else file, anchor) for page, anchor in PAGE_LINK.findall(text)]
        for page, anchor in links:
            if not page.is_file() or anchor not in _anchors(page):
                found.append(f"{page.relative_to(root).as_posix()}#{anchor}")
        if found:
            problems[name] = found
    return problems


def test_every_citation_is_a_paper_or_a_section_of_docs_and_every_docs_anchor_exists():
    problems = _citation_problems(ROOT)
    new = {name: found for name, found in problems.items() if name not in CLOSED_CITATIONS_LEFT}
    assert not new, f"cite papers by title and arXiv id, and sections as docs/<page>.md#<anchor> that exist: {new}"
    done = CLOSED_CITATIONS_LEFT - set(problems)
    assert not done, f"these cite nothing closed now, drop them from CLOSED_CITATIONS_LEFT: {sorted(done)}"


def test_the_citation_check_finds_seed_files_spec_sections_and_missing_anchors(tmp_path):
    """The check above is not vacuous: each kind of closed citation and a link to a missing heading is reported,
    and a link to an existing heading (one with punctuation, one inside a code block ignored) is not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "methods").mkdir()
    (tmp_path / "configs").mkdir()
    (tmp_path / "docs" / "tap.md").write_text(
        "# TAP\n\n## The model (MoME)\n\n```\n# not a heading\n```\n[up](#tap) [down](#not-a-heading)\n")
    spec, seed = "spec", "000_a0f3b72231afa875"
    (tmp_path / "methods" / "a.py").write_text(f'"""Seed {seed}.txt; docs/tap.md#the-model-mome."""\n')
    (tmp_path / "methods" / "b.py").write_text(f"# see docs/tap.md#the-method and {spec} tap.md\n")
    (tmp_path / "configs" / "c.yaml").write_text(f"# the {spec}'s \u00a78 ladder\n")
    (tmp_path / "configs" / "d.yaml").write_text("# TAP (arXiv 2509.26524), docs/tap.md#tap\n")
    assert _citation_problems(tmp_path) == {
        "docs/tap.md": ["docs/tap.md#not-a-heading"],
        "methods/a.py": [seed],
        "methods/b.py": [f"{spec} tap.md", "docs/tap.md#the-method"],
        "configs/c.yaml": [f"{spec}'s \u00a7"],
    }
