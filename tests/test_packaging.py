"""The wheel carries the CUDA sources: a non-editable install finds them next to the package."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _clean_checkout(dst: Path) -> Path:
    """The files a fresh clone has that the build reads (the package, the CUDA sources, the metadata),
    without the working tree's build/ or egg-info, which setuptools would reuse: a module deleted
    from the source but left in build/lib would otherwise still land in the wheel."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("cuflash", "cuda_src"):
        shutil.copytree(REPO / name, dst / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    return dst


@pytest.mark.slow
def test_wheel_ships_cuda_sources_and_finds_them(tmp_path):
    pytest.importorskip("setuptools")
    src = _clean_checkout(tmp_path / "src")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = tmp_path.glob("cuflash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "cuda_src").iterdir() if p.suffix in (".cuh", ".h", ".cu"))
    assert sources, "no CUDA sources in the repository?"
    for name in sources:
        assert f"cuflash/cuda_src/{name}" in names, f"{name} missing from the wheel"
    # Every module of the package, subpackages included (cuflash/plan/), and no other.
    modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "cuflash").rglob("*.py") if "__pycache__" not in p.parts)
    assert "cuflash/jit.py" in modules and "cuflash/plan/__init__.py" in modules
    missing = [m for m in modules if m not in names]
    assert not missing, f"modules missing from the wheel (pyproject.toml [tool.setuptools] packages?): {missing}"
    extra = sorted(n for n in names if n.startswith("cuflash/") and n.endswith(".py") and n not in modules)
    assert not extra, f"the wheel has modules the source tree does not: {extra}"
    assert any(n.endswith("entry_points.txt") for n in names)

    target = tmp_path / "site"
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert inst.returncode == 0, inst.stdout + inst.stderr
    env = dict(os.environ, PYTHONPATH=str(target))
    probe = subprocess.run(
        [sys.executable, "-c", "import cuflash, cuflash.jit as j, cuflash.plan as p; print(cuflash.__file__); "
         "print(j.source_dir()); print(p.__file__); print(len(p.all_decode_specs('sm_90a')))"],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    pkg_file, src_dir, plan_file, n_decode = probe.stdout.split()
    assert Path(pkg_file).is_relative_to(target), "imported the checkout, not the installed wheel"
    assert Path(src_dir) == target / "cuflash" / "cuda_src"
    assert Path(plan_file) == target / "cuflash" / "plan" / "__init__.py" and int(n_decode) > 0
