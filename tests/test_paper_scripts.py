"""The papers' config generators and reproduction scripts (benchmarks/papers/) live outside the installed package and
take the repository as an argument: the generators reproduce the checked-in configs in another folder, and the paper
packages under methods/ hold plug-ins only."""

from __future__ import annotations

from pathlib import Path

import fedmosaic_configs
import fedyolo_configs
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("generator", [fedmosaic_configs, fedyolo_configs], ids=lambda module: module.__name__)
def test_a_generator_writes_the_checked_in_configs_into_the_repository_it_is_given(generator, tmp_path, capsys):
    for folder in ("fedyolo", "tune"):
        (tmp_path / "configs" / folder).mkdir(parents=True)
    generator.main(["--repo", str(tmp_path)])
    written = sorted(path.relative_to(tmp_path) for path in (tmp_path / "configs").rglob("*.yaml"))
    assert len(written) >= 10
    stale = [str(path) for path in written if (ROOT / path).read_text() != (tmp_path / path).read_text()]
    assert not stale, f"stale: run python benchmarks/papers/{generator.__name__}.py"


def test_a_generator_refuses_a_folder_that_is_not_a_repository(tmp_path):
    with pytest.raises(SystemExit, match="has no configs/ folder: pass the rayfed repository's root"):
        fedyolo_configs.main(["--repo", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_the_paper_packages_hold_no_scripts():
    scripts = [path.relative_to(ROOT).as_posix() for path in sorted((ROOT / "methods").rglob("*.py"))
               if "__main__" in (text := path.read_text()) or "__file__" in text]
    assert scripts == [], "a script belongs in benchmarks/papers/ and takes the repository as --repo"
