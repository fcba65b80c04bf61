"""The wheel carries the CUDA sources: a non-editable install finds them next to the package."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_ships_cuda_sources_and_finds_them(tmp_path):
    pytest.importorskip("setuptools")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = tmp_path.glob("cuflash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "cuda_src").iterdir() if p.suffix in (".cuh", ".h", ".cu"))
    assert sources, "no CUDA sources in the repository?"
    for name in sources:
        assert f"cuflash/cuda_src/{name}" in names, f"{name} missing from the wheel"
    assert "cuflash/jit.py" in names and any(n.endswith("entry_points.txt") for n in names)

    target = tmp_path / "site"
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert inst.returncode == 0, inst.stdout + inst.stderr
    env = dict(os.environ, PYTHONPATH=str(target))
    probe = subprocess.run(
        [sys.executable, "-c", "import cuflash, cuflash.jit as j; print(cuflash.__file__); print(j.source_dir())"],
        capture_output=True, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    pkg_file, src_dir = probe.stdout.split()
    assert Path(pkg_file).is_relative_to(target), "imported the checkout, not the installed wheel"
    assert Path(src_dir) == target / "cuflash" / "cuda_src"
