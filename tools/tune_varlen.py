"""Where packed (varlen) batches lose against an even batch: the same tokens timed as an even dense
batch, as a packed batch of equal lengths, and as the ragged batch of `cuflash bench --varlen`, with
the planner's kernels and with forced tiles, side by side in one run (CUDA events, median).

    python tools/tune_varlen.py [--op fwd|bwd|all] [--hd 64 --hd 128] [--mean 512 ...] [--tokens 16384]

Columns (TFLOP/s of the useful scores, the bench's FLOP model):
  even      cuflash.attention on tokens / mean sequences of mean tokens (dense layout)
  packed=   the same sequences packed (attention_varlen): the varlen kernels' own overhead
  ragged    lengths uniform in [1, 2 mean] (bench_varlen.draw_lengths), the planner's kernel
  then one column per forced tile on the ragged batch (forward: the default and the short-key TMA
  tiles; backward: the planned TMA tile's query rows and ring depths, e.g. ws128r3s, and the cp.async kernel).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=["fwd", "bwd", "all"], default="all")
    ap.add_argument("--hd", type=int, action="append")
    ap.add_argument("--mean", type=int, action="append")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    import cupy

    from cuflash import attention, attention_backward, plan, varlen
    from cuflash.bench import time_ms
    from cuflash.bench_varlen import draw_lengths, pairs
    from cuflash.checks import BF16

    ops = ["fwd", "bwd"] if args.op == "all" else [args.op]
    print(f"{'op':4} {'hd':>3} {'causal':6} {'mean':>5} | TFLOP/s: even / packed= / ragged | forced tiles on ragged")
    for op in ops:
        for hd in args.hd or [64, 128]:
            for causal in (False, True):
                for mean in args.mean or [512, 2048, 8192]:
                    n, h, tokens = args.tokens // mean, args.heads, args.tokens
                    rng = cupy.random.default_rng(0)
                    q, k, v, do = (rng.standard_normal((tokens, h, hd), dtype=cupy.float32).astype(BF16) for _ in range(4))
                    ragged = draw_lengths(mean, tokens)
                    cases = {"even": [mean] * n, "packed=": [mean] * n, "ragged": ragged}
                    fns, flops = {}, {}
                    mult = 1.0 if op == "fwd" else 2.5
                    for name, lengths in cases.items():
                        flops[name] = 4.0 * hd * pairs(lengths, causal) * h * mult
                    tiles: dict = {}
                    bucket = plan.head_dim_bucket(hd)
                    if op == "fwd":
                        tiles = {"default": plan.FWD_SM90_WS_TILES[bucket]}
                        if bucket in plan.FWD_SM90_WS_SHORT_TILES:
                            tiles["short"] = plan.FWD_SM90_WS_SHORT_TILES[bucket]
                    else:
                        ws = plan.BWD_SM90_WS_TILES[bucket]  # (its block_n: 64 at head dim 256)
                        tiles = {f"ws{ws.block_m}r{s}s": dataclasses.replace(ws, stages=s) for s in (2, 3) if bucket == 64 or s == 2}
                        tiles["cp.async"] = plan.BWD_SM90_TILES[bucket]
                    for name, lengths in list(cases.items()) + [(t, ragged) for t in tiles]:
                        tot = sum(lengths)
                        cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
                        mx = max(lengths)
                        tile = tiles.get(name)
                        flops.setdefault(name, flops["ragged"])
                        if name == "even":
                            qe, ke, ve, de = (x[:tot].reshape(n, mean, h, hd) for x in (q, k, v, do))
                            if op == "fwd":
                                fns[name] = lambda qe=qe, ke=ke, ve=ve: attention(qe, ke, ve, causal=causal)
                            else:
                                oe, le = attention(qe, ke, ve, causal=causal, return_lse=True)
                                fns[name] = (lambda qe=qe, ke=ke, ve=ve, de=de, oe=oe, le=le:
                                             attention_backward(de, qe, ke, ve, oe, le, causal=causal))  # fmt: skip
                            continue
                        qp, kp, vp, dp = (x[:tot] for x in (q, k, v, do))
                        if op == "fwd":
                            fns[name] = (lambda qp=qp, kp=kp, vp=vp, cu=cu, mx=mx, tile=tile:
                                         varlen.run(qp, kp, vp, cu, cu, mx, mx, causal=causal, tile=tile))  # fmt: skip
                        else:
                            o, lse = varlen.run(qp, kp, vp, cu, cu, mx, mx, causal=causal, return_lse=True)
                            fns[name] = (lambda qp=qp, kp=kp, vp=vp, dp=dp, o=o, lse=lse, cu=cu, mx=mx, tile=tile:
                                         varlen.run_backward(dp, qp, kp, vp, o, lse, cu, cu, mx, mx, causal=causal,
                                                             tile=tile))  # fmt: skip
                    for fn in fns.values():
                        fn()
                    ms = time_ms(fns, repeats=args.repeats)
                    tf = {name: flops[name] / (ms[name] * 1e-3) / 1e12 for name in fns}
                    forced = "  ".join(f"{t} {tf[t]:6.1f}" for t in tiles)
                    print(f"{op:4} {hd:3d} {str(causal):6} {mean:5d} | {tf['even']:6.1f} {tf['packed=']:6.1f} "
                          f"{tf['ragged']:6.1f} | {forced}   (ragged/even {tf['ragged'] / tf['even']:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
