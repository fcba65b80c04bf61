"""Check in the SASS that the warp-specialized forward's softmax overlaps the previous tile's P V.

The consumer's main loop waits for S_t (wgmma.wait_group 1), runs the softmax, then waits for
P_{t-1} V_{t-1} (wgmma.wait_group 0). ptxas is free to move that second wait (WARPGROUP.DEPBAR.LE
gsb0, 0x0) up to the top of its basic block, and did, ahead of the whole softmax, for every build before
session 17: the exponentials then ran after the P V product instead of under it. This compiles each
warp-specialized forward variant with the local nvcc (no GPU) and counts the MUFU.EX2 between each
"DEPBAR.LE gsb0, 0x1" and the next "DEPBAR.LE gsb0, 0x0": the main loop must have a tile's worth.

    python tools/check_overlap_sass.py [-j 2] [--match hd128]
Exit status 1 if some overlapped variant's main loop has its exponentials after the wait.

What it reads is the SASS of nvcc 13's ptxas (the GPU machine's NVRTC is 13.0 too); the cuda12 extra's
NVRTC 12.9 has its own ptxas, whose cubins this nvdisasm cannot read, so that build is not checked.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import re
import sys

from sass_digest import (  # (tools/ is on sys.path: this script's own folder)
    nvdisasm,
    sass_of,
)

from cuflash import plan


def exps_under_pv(sass: str) -> list[int]:
    """For each "DEPBAR.LE gsb0, 0x1" of the SASS: the MUFU.EX2 up to the next "DEPBAR.LE gsb0, 0x0"."""
    counts, open_count = [], None
    for line in sass.splitlines():
        if re.search(r"DEPBAR\.LE gsb0, 0x1\b", line):
            open_count = 0
        elif re.search(r"DEPBAR\.LE gsb0, 0x0\b", line):
            if open_count is not None:
                counts.append(open_count)
            open_count = None
        elif open_count is not None and "MUFU.EX2" in line:
            open_count += 1
    return counts


def check(spec, exe: str) -> tuple[str, list[int], int]:
    """(name, exps_under_pv counts, the exponentials of one tile per thread)."""
    return spec.name, exps_under_pv(sass_of(spec, exe)), spec.tile.block_n // 2  # 64 rows x block_n per warpgroup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--match", nargs="*", default=[], help="only variants whose name contains one of these")
    a = ap.parse_args()
    specs = [s for s in plan.all_fwd_specs("sm_90a") if s.name.startswith("flash_fwd_sm90_ws") and s.tile.overlap
             and (not a.match or any(m in s.name for m in a.match))]
    exe, bad = nvdisasm(), 0
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        for name, counts, per_thread in pool.map(lambda s: check(s, exe), specs):
            ok = bool(counts) and max(counts) >= per_thread
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {name}: exponentials between the S wait and the P V wait {counts} "
                  f"(a tile: {per_thread})", flush=True)
    print(f"{len(specs) - bad} of {len(specs)} variants overlap the softmax with P V")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
