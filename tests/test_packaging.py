"""Packaging: one import name `bestiary`, an explicit package list that covers every package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"tests", "build", "dist", "docs", "benchmarks", "site"}


def declared_packages() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(data["tool"]["setuptools"]["packages"])


def package_dirs() -> set[str]:
    found = {"bestiary"}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if not rel.parts or rel.parts[0] in SKIP_DIRS or any(p.startswith(".") for p in rel.parts):
            continue
        found.add(".".join(("bestiary", *rel.parts)))
    return found


def test_package_list_covers_every_package():
    assert declared_packages() == package_dirs()


def test_no_double_import_traps():
    assert not (ROOT / "conftest.py").exists()
    assert not (ROOT / "tests" / "__init__.py").exists()
    text = (ROOT / "__init__.py").read_text()
    assert "from ." not in text and "import core" not in text


def test_entry_points_name_existing_modules():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for name, target in data["project"]["entry-points"]["bestiary.architectures"].items():
        assert target in declared_packages(), (name, target)


def test_torch_not_in_build_requires():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not any(r.startswith("torch") for r in data["build-system"]["requires"])


@pytest.mark.slow
def test_regular_install_has_no_top_level_core(tmp_path):
    """`pip install .` puts only `bestiary` (and its dist-info) into site-packages."""
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    top = {p.name for p in tmp_path.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert top == {"bestiary"}, top
    assert (tmp_path / "bestiary" / "models" / "llama" / "__init__.py").is_file()
    # package data: the calibration texts, read through importlib.resources from the install
    read = ("import hashlib; from bestiary.core.quant.calib_text import WEIGHT_CALIB_TEXT as t; "
            "print(hashlib.sha256(t.encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {read}"],
                         capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "3ee5c6b90296727a6d40731476b213515ec4d76185b797b9acc42515188d10c7"
    check = "import bestiary.models.llama, bestiary.core.cli.main; import importlib.util as u; assert u.find_spec('core') is None"
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
