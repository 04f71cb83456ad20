"""Plug-ins are found from one list: the modules installed distributions name under the entry-point group
``rayfed.plugins`` (rayfed's own built-ins in its pyproject.toml), which the registry imports at the first look-up."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from rayfed import registry
from rayfed.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_the_installed_list_is_pyproject_s_engine_first_and_every_built_in_name_resolves():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][registry.PLUGIN_GROUP]
    modules = registry.plugin_modules()
    assert sorted(modules) == sorted(listed.values())  # installed as written (else: pip install -e .)
    methods = [module.startswith("rayfed.methods.") for module in modules]
    assert methods == sorted(methods) and any(methods) and not all(methods)
    for kind in registry.KINDS:
        built_in = [entry for entry in registry.entries(kind) if entry.builtin]
        assert built_in, kind
        for entry in built_in:
            name = entry.name + "x" if entry.prefix else entry.name
            assert registry.resolve(kind, name).obj is entry.obj
    assert {"fedavg", "tap", "fedmosaic", "feddat", "pfedmma", "fedyolo"} <= set(registry.names("method"))


def _fake_distribution(folder: Path, module: str, listed: str) -> None:
    """An installed distribution ``fake-paper`` listing ``listed`` under rayfed.plugins, and its ``module``."""
    info = folder / "fake_paper-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-paper\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{registry.PLUGIN_GROUP}]\nfake = {listed}\n")
    (folder / f"{module}.py").write_text(
        "import rayfed\n\n\n@rayfed.register_method('fake-paper-method')\nclass FakePaper(rayfed.Method):\n"
        "    aggregation = rayfed.WeightedMean()\n")


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as a new process has it, restored afterwards."""
    monkeypatch.setattr(registry, "_ENTRIES", {kind: dict(entries) for kind, entries in registry._ENTRIES.items()})
    monkeypatch.setattr(registry, "_plugins_loaded", False)


def test_a_plug_in_another_distribution_lists_is_found_after_the_built_ins(tmp_path, monkeypatch, fresh_registry):
    _fake_distribution(tmp_path, "fake_paper_plugins", "fake_paper_plugins")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert registry.plugin_modules()[-1] == "fake_paper_plugins"
    found = registry.resolve("method", "fake-paper-method").obj
    assert found.__name__ == "FakePaper" and found.__module__ == "fake_paper_plugins"


def test_a_listed_module_that_cannot_be_imported_is_one_sentence(tmp_path, monkeypatch, fresh_registry):
    _fake_distribution(tmp_path, "unused", "fake_paper_missing")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^plug-in module 'fake_paper_missing' \(listed under the entry-point group "
                                          r"rayfed\.plugins\) cannot be imported \(No module named"):
        registry.names("method")


def test_a_checkout_run_without_installing_reads_the_list_in_its_pyproject(monkeypatch, tmp_path):
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [])
    installed = registry.plugin_modules()
    assert installed[0] == "rayfed.data.sources" and "rayfed.methods.tap" in installed
    assert set(installed) == set(registry.checkout_plugin_modules())
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert registry.checkout_plugin_modules(tmp_path / "pyproject.toml") == []
    assert registry.checkout_plugin_modules(tmp_path / "missing.toml") == []


def test_an_install_without_rayfed_s_list_says_to_reinstall(monkeypatch, fresh_registry):
    listed = registry.importlib.metadata.entry_points
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(registry, "checkout_plugin_modules", lambda: [])
    with pytest.raises(ConfigError, match=r"rayfed's installed metadata lists no rayfed\.plugins entry points .*: "
                                          r"reinstall rayfed \(pip install -e \.\)\.$"):
        registry.resolve("method", "fedavg")
    imported = []  # reinstalled, the same process loads the list at its next look-up
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", listed)
    monkeypatch.setattr(registry.importlib, "import_module", imported.append)
    registry.names("method")
    assert imported == registry.plugin_modules()
