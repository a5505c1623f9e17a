"""The configs ship inside the wheel: an installed relaytrain finds them from any directory."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_install_finds_its_configs_from_any_directory(tmp_path):
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheel_dir), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    # Every folder of configs is declared: setuptools' ~40 lines per undeclared one are not printed.
    assert "would be ignored" not in build.stdout + build.stderr
    wheel, = wheel_dir.glob("relaytrain-*.whl")
    shipped = {name.removeprefix("relaytrain/configs/") for name in zipfile.ZipFile(wheel).namelist()
               if name.startswith("relaytrain/configs/") and name.endswith((".yaml", ".json"))}
    assert shipped == {str(f.relative_to(ROOT / "configs")) for f in config_files()}
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import relaytrain; print(relaytrain.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(target))  # the wheel, not the checkout
    cfg = subprocess.run([sys.executable, "-m", "relaytrain.commands.cli", "train", "+exp=tiny_baseline", "--cfg", "job"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert cfg.returncode == 0, cfg.stderr
    assert "num_layers: 2" in cfg.stdout and "name: bert_tiny" in cfg.stdout


def test_editable_install_reads_the_checkouts_configs():
    import relaytrain.configs

    assert Path(relaytrain.configs.__file__).resolve().parent == ROOT / "configs"


def config_files() -> list[Path]:
    return [f for f in (ROOT / "configs").rglob("*") if f.suffix in (".yaml", ".json")]


def test_every_package_of_the_source_is_in_the_wheel():
    """pyproject.toml lists packages by hand: a new folder left out would be missing from every
    wheel install while an editable checkout runs fine. A folder of configs is a package too (a
    namespace package to Python): one left out makes setuptools warn at length on every install."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    source = ROOT / "src"
    found = {".".join(init.parent.relative_to(source).parts) for init in source.glob("relaytrain/**/__init__.py")}
    found |= {".".join(("relaytrain", "configs", *f.parent.relative_to(ROOT / "configs").parts))
              for f in config_files()}
    assert found - listed == set(), f"add to pyproject.toml's packages: {sorted(found - listed)}"
