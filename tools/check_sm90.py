"""Structured checks of the Hopper (wgmma) forward that say which stage is wrong when it is.

    python tools/check_sm90.py [--ws]
For each Hopper head-dim bucket and one tile of keys, the cp.async kernel's tile (FWD_SM90_TILES) and
the warp-specialized TMA kernel's (FWD_SM90_WS_TILES) with each schedule (--ws: only those):
  uniform  q = 0, so P is uniform: out = mean of V rows (tests the P V product and V's layout);
  onehot   v = one-hot rows (key j -> column j % d): out[i, c] = sum of P over keys j == c (mod d)
           (tests S = Q K^T and the softmax, through a known V);
  random   random q, k, v against the float64 reference, causal and not, ragged lengths.
Prints the max abs error per check; exit status 1 if any exceeds the DESIGN.md bound.
"""
import dataclasses
import sys

import numpy as np


def tiles(ws_only: bool):
    """(head dim, tile) pairs to check: every schedule of the warp-specialized kernel, and the cp.async one."""
    from cuflash import plan

    for hd, t in sorted(plan.FWD_SM90_WS_TILES.items()):
        for overlap, pingpong in ((True, True), (True, False), (False, True), (False, False)):
            yield hd, dataclasses.replace(t, overlap=overlap, pingpong=pingpong)
    if not ws_only:
        yield from sorted(plan.FWD_SM90_TILES.items())


def main() -> int:
    import cupy

    from cuflash import forward, reference
    from cuflash.checks import BF16

    rng = np.random.default_rng(0)
    bad = 0
    for hd, tile in tiles("--ws" in sys.argv[1:]):
        for dtname, dt in (("bf16", BF16), ("fp16", np.dtype(np.float16))):
            def run(q, k, v, causal=False):
                args = [cupy.asarray(x.astype(dt)) for x in (q, k, v)]
                out, lse = forward.run(*args, causal=causal, return_lse=True, tile=tile)
                ref, ref_lse = reference.attention_forward(*args, causal=causal)
                plain = reference.plain_attention_bar(*args, ref, causal=causal, dtype=dt)
                got = out.get().astype(np.float64)
                err = reference.max_abs_error(got, ref)
                bound = 2 * reference.max_abs_error(plain, ref) + 1e-5
                lse_err = float(np.nanmax(np.abs(lse.get() - ref_lse))) if np.isfinite(ref_lse).any() else 0.0
                return err, bound, lse_err, got, ref

            n = tile.block_n
            m = tile.block_m
            cases = {}
            q = np.zeros((1, m, 1, hd), np.float32)
            k = rng.standard_normal((1, n, 1, hd), dtype=np.float32)
            v = rng.standard_normal((1, n, 1, hd), dtype=np.float32)
            cases["uniform"] = run(q, k, v)
            q = rng.standard_normal((1, m, 1, hd), dtype=np.float32)
            v = np.zeros((1, n, 1, hd), np.float32)
            v[0, np.arange(n), 0, np.arange(n) % hd] = 1.0
            cases["onehot"] = run(q, k, v)
            for causal in (False, True):
                q = rng.standard_normal((2, 3 * m + 17, 2, hd), dtype=np.float32)
                k = rng.standard_normal((2, 5 * n + 9, 1, hd), dtype=np.float32)
                v = rng.standard_normal((2, 5 * n + 9, 1, hd), dtype=np.float32)
                cases[f"random causal={int(causal)}"] = run(q, k, v, causal)
            for name, (err, bound, lse_err, got, ref) in cases.items():
                ok = err <= bound and not np.isnan(got).any()
                bad += not ok
                extra = ""
                if not ok:
                    diff = np.abs(got - ref)[0, :, 0, :]
                    rows = np.where(diff.max(axis=1) > bound)[0]
                    cols = np.where(diff.max(axis=0) > bound)[0]
                    extra = f"  bad rows {rows[:8].tolist()}.. ({len(rows)})  bad cols {cols[:8].tolist()}.. ({len(cols)})"
                print(f"hd{hd} {tile} {dtname} {name:16s} err {err:.3g} bound {bound:.3g} lse err {lse_err:.3g} "
                      f"{'ok' if ok else 'WRONG'}{extra}", flush=True)
    print("check_sm90:", "all ok" if not bad else f"{bad} WRONG")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
