"""docs/architecture.md names only what exists (files, tests, modules, attributes, registered plug-ins), lists every
hook of ``Method``, states the import rules as tests/test_plugins.py enforces them, and its layer table holds for
every import of the package."""

from __future__ import annotations

import importlib
import importlib.util
import re

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
