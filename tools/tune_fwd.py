"""Sweep forward tile shapes on the GPU at a few points of the paper grid, side by side with
torch's FlashAttention-2, to choose the rows of cuflash/plan/forward.py FWD_TILES.

    python tools/tune_fwd.py [--hd 64 128 256] [--seqlen 2048 8192] [--dtype bf16] [--sm90 | --ws]
--sm90 sweeps the Hopper (wgmma) kernel's tiles (FWD_SM90_TILES) instead of the mma.sync kernel's; --ws the
warp-specialized TMA kernel's tiles and schedules (FWD_SM90_WS_TILES; its ablations). --variant V (window,
softcap, alibi, dropout) times the tiles with that variant against its peer (cuflash.bench_variants:
FlexAttention, or SDPA FlashAttention-2 with the same dropout), beside SDPA FlashAttention-2 without it;
a tile the variant cannot run (dropout: key tiles of a multiple of 32) is skipped. Each tile's results are
checked against the reference without the variant (tests/test_variants_gpu.py checks the variants on the
planner's tiles); the window is bench_variants' (1024 keys, causal), so at 1024 tokens it is the causal mask.
Prints one line per (head dim, tile, causal, seqlen) and, last, the best tile per head dim.
"""
import argparse
import dataclasses
import statistics

from cuflash import bench, bench_variants, plan
from cuflash.plan import Sm90Tile, Sm90WsTile, Tile

VARIANT_BITS = {"window": plan.MOD_WINDOW, "softcap": plan.MOD_SOFTCAP, "alibi": plan.MOD_ALIBI,
                "dropout": plan.MOD_DROPOUT}  # fmt: skip

T = Tile
CANDIDATES = {  # (block_m, block_n, warps, q_in_regs, min_blocks, stages)
    32: [T(128, 64, 4, True, 2), T(128, 128, 4, True, 2, 1)],
    64: [T(128, 64, 4, True, 2), T(128, 64, 4, True, 2, 1), T(128, 128, 4, False, 2, 1), T(128, 128, 4, True, 2, 1)],
    96: [T(128, 64, 4, False, 2), T(128, 64, 4, False, 2, 1)],
    128: [T(128, 64, 4, False, 2), T(128, 64, 4, False, 2, 1), T(128, 32, 4, False, 2)],
    160: [T(128, 64, 8, True, 1), T(64, 64, 4, True, 2, 1), T(128, 32, 4, False, 2, 1)],
    192: [T(128, 64, 8, True, 1), T(64, 64, 4, True, 2, 1), T(64, 64, 4, False, 2, 1)],
    224: [T(128, 64, 8, False, 1), T(64, 64, 4, False, 2, 1)],
    256: [T(128, 64, 8, False, 1), T(64, 64, 4, False, 2, 1), T(64, 32, 4, False, 2, 2)],
}


H = Sm90Tile
SM90_CANDIDATES = {  # (block_m, block_n, stages, min_blocks)
    64: [H(128, 64), H(128, 64, min_blocks=2), H(128, 128, min_blocks=2), H(192, 64)],
    128: [H(128, 128), H(128, 64, min_blocks=2)],
    256: [H(128, 64)],
}


W = Sm90WsTile


def P(*args, tma_store=False, **kw):  # a persistent tile, O out by 16-byte stores (the planner's short-key tiles)
    return W(*args, persistent=True, tma_store=tma_store, **kw)


SM90_WS_CANDIDATES = {  # (block_m, block_n, stages, overlap, pingpong, persistent, tma_store): tiles and schedule ablations
    64: [W(192, 128, pingpong=False), P(192, 128, pingpong=False), W(128, 128, pingpong=False),
         P(128, 128, pingpong=False), W(128, 128), P(128, 128),
         W(192, 128, overlap=False, pingpong=False), W(128, 192, pingpong=False), W(128, 176, pingpong=False),
         P(128, 192, pingpong=False), P(128, 176, pingpong=False),
         W(192, 128, pingpong=False, tma_store=False), P(128, 128, pingpong=False, tma_store=True)],
    128: [W(128, 128, pingpong=False), P(128, 128, pingpong=False), W(128, 192, pingpong=False),
          W(128, 176, pingpong=False), W(128, 160, pingpong=False), W(128, 144, pingpong=False), W(128, 128),
          P(128, 128), W(128, 128, overlap=False, pingpong=False), W(128, 128, overlap=False),
          W(128, 128, pingpong=False, tma_store=False), P(128, 128, pingpong=False, tma_store=True)],
    256: [W(128, 64, pingpong=False), W(128, 80, pingpong=False), W(128, 64), W(128, 64, overlap=False, pingpong=False),
          W(128, 64, overlap=False), W(128, 80, pingpong=False, tma_store=False)],
}
# Each tile again with clusters of 2 sharing K/V by TMA multicast (and, where shared memory allows, 3 stages).
for _d, _tiles in SM90_WS_CANDIDATES.items():
    _tiles += [dataclasses.replace(t, cluster=2) for t in _tiles[:2]]
SM90_WS_CANDIDATES[64] += [W(192, 128, 3, pingpong=False, cluster=2), P(128, 128, pingpong=False, cluster=2)]
SM90_WS_CANDIDATES[128] += [W(128, 128, 3, pingpong=False, cluster=2)]
# hd128 with 3 consumer warpgroups: 1.5x the query rows per K/V byte, which the forward's steady state is
# short of (docs/history/hopper.md, session 16); O + S + P fit 160 registers at 80 or 64 keys (no spills,
# no wgmma notes: checked with NVRTC, not yet timed)
SM90_WS_CANDIDATES[128] += [W(192, 80, pingpong=False), W(192, 80, 3, pingpong=False), W(192, 64, 4, pingpong=False),
                            W(192, 80, 3, pingpong=False, cluster=2)]
# hd64's 192-row tile with 64-key tiles: the variants that spill at 128 keys (dropout, softcap) do not at 64;
# hd128's 192 x 64: what its default tile is with dropout's key tiles (multiples of 32: plan.fit_key_tile)
SM90_WS_CANDIDATES[64] += [W(192, 64, pingpong=False), W(192, 64, 3, pingpong=False)]
SM90_WS_CANDIDATES[128] += [W(192, 64, pingpong=False)]
# hd64's short keys on 3 consumer warpgroups, persistent: 64 or 96 keys per tile fit 160 registers without
# spills (192 x 128 persistent parks ~80 bytes: session 11): more warps per scheduler for the softmax's latencies,
# measured 0.75-0.79 of cuDNN at 512-2048 tokens against the planned 128 x 128's 0.87 (session 31)
SM90_WS_CANDIDATES[64] += [P(192, 64, pingpong=False), P(192, 96, pingpong=False)]
# Ping-pong again once the softmax really overlaps P V inside a warpgroup (session 17): FlashAttention-3's
# hd256 tile with it (head dims 64 and 128 have theirs above)
SM90_WS_CANDIDATES[256] += [W(128, 80)]
# The look-ahead on the planner's persistent short-key tiles: each item's first S issued right after the item
# before's last P V, so that it runs under that item's epilogue, Q in two slots (built in session 33 without a
# GPU; --match "bm128 bn128 st2 overlap=1 pingpong=0 persistent=1 tmastore=0 cluster=1" lookahead=1 times them
# beside the planner's short-key tile)
SM90_WS_CANDIDATES[64] += [P(128, 128, pingpong=False, look_ahead=True), P(128, 128, 3, pingpong=False, look_ahead=True)]
SM90_WS_CANDIDATES[128] += [P(128, 128, pingpong=False, look_ahead=True)]
# hd128's 3-warpgroup default tile, persistent: the 1.5x query rows per K/V byte of 192 x 80 with the next item's
# loads under this one's epilogue, for the 1k-8k keys where the per-tile 192 x 80 and the persistent 128 x 128
# trade places (its 172 bytes of local memory are the item's walk state, stored and loaded outside the key loop).
# Session 38, H100, bf16, 1k-8k tokens x causal, median ratio to cuDNN: 2 stages 0.684, 3 stages 0.712, against
# the per-tile 192 x 80's 0.948 and the persistent 128 x 128's 0.910 in the same run (causal 1k-8k: 240-421
# TFLOP/s against 296-593): not a candidate for the planner
SM90_WS_CANDIDATES[128] += [P(192, 80, pingpong=False), P(192, 80, 3, pingpong=False)]
# The persistent short-key tile on the strided walk (Sm90WsTile.paired=False; P(128, 128) above takes the paired one,
# the planner's since session 39 at both head dims). Causal only: non-causal tiles all cost the same
for _d in (64, 128):
    SM90_WS_CANDIDATES[_d] += [P(128, 128, pingpong=False, paired=False)]


def describe(tile) -> str:
    if isinstance(tile, Sm90WsTile):
        return (f"ws bm{tile.block_m} bn{tile.block_n} st{tile.stages} overlap={int(tile.overlap)} "
                f"pingpong={int(bool(tile.sched & 2))} persistent={int(tile.persistent)} tmastore={int(tile.tma_store)} "
                f"cluster={tile.cluster} lookahead={int(tile.look_ahead)}"
                f"{' paired=' + str(int(tile.paired)) if tile.persistent else ''}")
    if isinstance(tile, Sm90Tile):
        return f"sm90 bm{tile.block_m} bn{tile.block_n} st{tile.stages} mb{tile.min_blocks}"
    return f"bm{tile.block_m} bn{tile.block_n} w{tile.warps} qreg={int(tile.q_in_regs)} st={tile.stages}"


def check_tile(hd, tile, dtype):
    """A ragged causal and non-causal case against the float64 reference with this tile."""
    import cupy
    import numpy as np

    from cuflash import forward, reference
    from cuflash.checks import numpy_dtype

    dt = numpy_dtype(dtype)
    rng = np.random.default_rng()
    for causal in (False, True):
        q, k, v = (cupy.asarray(rng.standard_normal(sh, dtype=np.float32).astype(dt))
                   for sh in ((2, 211, 2, hd), (2, 333, 1, hd), (2, 333, 1, hd)))
        out = forward.run(q, k, v, causal=causal, tile=tile)
        ref, _ = reference.attention_forward(q, k, v, causal=causal)
        plain = reference.plain_attention_bar(q, k, v, ref, causal=causal, dtype=dt)
        if not reference.within_tolerance(out.get().astype(np.float64), ref, plain):
            return False
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sm90", action="store_true", help="sweep the Hopper kernel's tiles")
    ap.add_argument("--ws", action="store_true", help="sweep the warp-specialized Hopper kernel's tiles and schedules")
    ap.add_argument("--variant", choices=bench_variants.VARIANTS,
                    help="time the tiles with this attention variant, against its peer")
    ap.add_argument("--match", nargs="*", default=[],
                    help="only the candidates whose description contains one of these strings (e.g. persistent=1)")
    a = ap.parse_args()
    candidates = SM90_WS_CANDIDATES if a.ws else SM90_CANDIDATES if a.sm90 else CANDIDATES
    # the ratios' peer, and a second column: the variant's peer and SDPA FA2 without it, or FA2 and cuDNN
    peer, second = (bench_variants.peer_of(a.variant), "flash (plain)") if a.variant else ("flash", "cudnn")
    best = {}
    for hd in a.hd:
        scores = {}
        for tile in candidates.get(hd, []):
            if a.match and not any(m in describe(tile) for m in a.match):
                continue
            ratios, vs_second = [], []
            if a.variant and isinstance(tile, Sm90WsTile):
                try:
                    plan.fwd_sm90_ws_spec(hd, a.dtype, True, tile, mods=VARIANT_BITS[a.variant])
                except ValueError as exc:
                    print(f"hd{hd} {describe(tile)}: skipped, not a {a.variant} tile: {exc}", flush=True)
                    continue
            if not check_tile(hd, tile, a.dtype):
                print(f"hd{hd} {describe(tile)}: WRONG RESULTS, skipped", flush=True)
                continue
            for causal in (True,) if a.variant == "window" else (False, True):  # (the variant bench's window is causal)
                for s in a.seqlen:
                    b, h = max(1, 16384 // s), 2048 // hd
                    try:
                        if a.variant:
                            row = bench_variants.run_point(a.variant, "fwd", a.dtype, hd, causal, s, b, h,
                                                           repeats=a.repeats, tile=tile)  # fmt: skip
                        else:
                            row = bench.run_point(a.dtype, hd, causal, s, b, h, repeats=a.repeats, peers=True,
                                                  naive_max_gb=0, tile=tile)  # fmt: skip
                        bench.release_memory()
                    except Exception as exc:  # e.g. too much shared memory for this tile
                        print(f"hd{hd} {tile} causal={causal} s={s}: FAILED {type(exc).__name__}: {exc}", flush=True)
                        continue
                    t = row.tflops
                    if "cuflash" not in t:
                        print(f"hd{hd} {tile} causal={causal} s={s}: cuflash failed: {row.notes}", flush=True)
                        continue
                    r = t["cuflash"] / t[peer] if peer in t else float("nan")
                    ratios.append(r)
                    if second in t:
                        vs_second.append(t["cuflash"] / t[second])
                    print(f"hd{hd} {describe(tile)} "
                          f"causal={int(causal)} s={s:5d}: cuflash {t['cuflash']:6.1f}  {peer} {t.get(peer, 0):6.1f} "
                          f"{second} {t.get(second, 0):6.1f}  ratio {r:.3f}", flush=True)
            if ratios:
                scores[tile] = (statistics.median(ratios), statistics.median(vs_second) if vs_second else float("nan"))
        if scores:
            best[hd] = max(scores, key=lambda t: scores[t][0])
            for tile, (sc, sd) in sorted(scores.items(), key=lambda kv: -kv[1][0]):
                print(f"  hd{hd} median ratio vs {peer} {sc:.3f} vs {second} {sd:.3f}  {describe(tile)}")
    print("BEST:", {hd: tuple(t.__dict__.values()) for hd, t in best.items()})


if __name__ == "__main__":
    main()
