"""Compile one kernel variant with the local nvcc and print ptxas's report (and optionally SASS).

No GPU needed. nvcc reads the same entry source and headers that cuflash hands to NVRTC.
    python tools/sass.py --hd 128 --dtype bf16 [--causal] [--arch sm_90a] [--sass] [--tile 128,64,4,0,2] [--bwd]
--bwd: the backward main kernel (its BWD_TILES row) instead of the forward.
"""
import argparse
import subprocess
import tempfile

from sass_digest import nvcc_cubin, nvdisasm  # (tools/ is on sys.path: this script's own folder)

from cuflash import plan


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
    with tempfile.TemporaryDirectory() as d:
        r = nvcc_cubin(spec, d, "-Xptxas=-v")
        print(spec.name)
        print(r.stderr.strip())
        if r.returncode == 0 and a.sass:
            print(subprocess.run([nvdisasm(), "-c", f"{d}/k.cubin"], capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
