"""Compile one kernel variant with the local nvcc and print ptxas's report (and optionally SASS).

No GPU needed. nvcc reads the same entry source and headers that cuflash hands to NVRTC.
    python tools/sass.py --hd 128 --dtype bf16 [--causal] [--arch sm_90a] [--sass] [--tile 128,64,4,0,2] [--bwd]
--bwd: the backward main kernel (its BWD_TILES row) instead of the forward.
"""
import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from cuflash import jit, plan


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--scalar", action="store_true", help="element-wise load variant")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--tile", help="block_m,block_n,warps,q_in_regs,min_blocks")
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="the backward main kernel")
    a = ap.parse_args()
    tile = plan.Tile(*[int(x) for x in a.tile.split(",")]) if a.tile else None
    if tile:
        tile = plan.Tile(tile.block_m, tile.block_n, tile.warps, bool(tile.q_in_regs), tile.min_blocks)
    if a.bwd:
        spec = plan.bwd_spec(a.hd, a.dtype, a.causal, not a.scalar, plan.parse_arch(a.arch))
    else:
        spec = plan.fwd_spec(a.hd, a.dtype, a.causal, not a.scalar, plan.parse_arch(a.arch), tile)
    text = jit.entry_source(spec)
    with tempfile.TemporaryDirectory() as d:
        for name, body in jit.included_headers(text).items():
            Path(d, name).write_text(body)
        Path(d, "entry.cu").write_text(text)
        arch = spec.arch.replace("sm_", "")
        cmd = ["nvcc", "-cubin", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas=-v",
               "-o", f"{d}/k.cubin", f"{d}/entry.cu"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(spec.name)
        print(r.stderr.strip())
        if r.returncode == 0 and a.sass:
            nvdisasm = os.environ.get("NVDISASM", "nvdisasm")
            print(subprocess.run([nvdisasm, "-c", f"{d}/k.cubin"], capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
