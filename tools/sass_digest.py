"""SASS fingerprints of every kernel variant, to prove that a change which only moves code leaves
the machine code alone. No GPU needed: the local nvcc compiles each variant's entry source and headers
(exactly what cuflash hands to NVRTC) to a cubin, nvdisasm prints its SASS, and the SHA-256 of that
text is recorded per variant name. (nvcc 13 rather than the NVRTC of the cuda12 extra: nvdisasm 13
reads only CUDA 13 cubins.)

    python tools/sass_digest.py --out before.json            # on the old tree
    python tools/sass_digest.py --out after.json             # on the new tree
    python tools/sass_digest.py --compare before.json after.json

Needs the package installed (pip install -e .) and nvdisasm on PATH or in NVDISASM
(pip install nvidia-cuda-nvdisasm ships one). Uses only cuflash.plan.all_*_specs,
cuflash.jit.entry_source and cuflash.jit.included_headers, which exist before and after the restructure.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time

ARCHS = ("sm_80", "sm_90a")


def nvdisasm() -> str:
    exe = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if exe:
        return exe
    try:  # the PyPI wheel nvidia-cuda-nvdisasm
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13/bin", "cuda_nvdisasm/bin"):
                cand = os.path.join(root, sub, "nvdisasm")
                if os.path.isfile(cand):
                    return cand
    except ImportError:
        pass
    sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or set NVDISASM")


def _specs():
    from cuflash import plan

    out = []
    for arch in ARCHS:
        out += plan.all_fwd_specs(arch) + plan.all_bwd_specs(arch) + plan.all_decode_specs(arch)
    return out


def nvcc_cubin(spec, folder: str, *options: str) -> subprocess.CompletedProcess:
    """Compile ``spec`` with the local nvcc into ``folder``/k.cubin, from the entry source and headers
    cuflash hands to NVRTC (written into ``folder``); ``options`` go after the usual ones."""
    from pathlib import Path

    from cuflash import jit

    text = jit.entry_source(spec)
    for name, body in jit.included_headers(text).items():
        Path(folder, name).write_text(body)
    Path(folder, "entry.cu").write_text(text)
    arch = spec.arch.replace("sm_", "")
    return subprocess.run(["nvcc", "-cubin", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", *options,
                           "-o", f"{folder}/k.cubin", f"{folder}/entry.cu"], capture_output=True, text=True)


def sass_of(spec, exe: str) -> str:
    """The SASS text of ``spec`` compiled by the local nvcc, as the nvdisasm ``exe`` prints it."""
    with tempfile.TemporaryDirectory() as d:
        nvcc_cubin(spec, d).check_returncode()
        return subprocess.run([exe, "-c", f"{d}/k.cubin"], capture_output=True, text=True, check=True).stdout


def _digest(args):
    spec, exe = args
    return spec.name, hashlib.sha256(sass_of(spec, exe).encode()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write {variant: sha256 of its SASS} here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    if a.compare:
        before, after = (json.load(open(p)) for p in a.compare)
        missing, extra = sorted(set(before) - set(after)), sorted(set(after) - set(before))
        changed = sorted(n for n in set(before) & set(after) if before[n] != after[n])
        print(f"{len(before)} before, {len(after)} after: {len(changed)} changed, {len(missing)} missing, "
              f"{len(extra)} new")
        for tag, names in (("changed", changed), ("missing", missing), ("new", extra)):
            for n in names:
                print(f"  {tag}: {n}")
        return 1 if changed or missing or extra else 0
    if not a.out:
        ap.error("--out or --compare")
    exe = nvdisasm()
    specs = _specs()
    t0 = time.time()
    result = {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=a.jobs, mp_context=ctx) as pool:
        for i, (name, h) in enumerate(pool.map(_digest, [(s, exe) for s in specs], chunksize=4)):
            result[name] = h
            if (i + 1) % 50 == 0 or i + 1 == len(specs):
                print(f"[{i + 1}/{len(specs)}] {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(sorted(result.items())), f, indent=0)
    print(f"{len(result)} variants -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
