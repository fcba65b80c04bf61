"""Small ragged forward, backward and decode cases for compute-sanitizer (memcheck / racecheck) on the GPU.

CuPy's memory pool hides out-of-bounds accesses inside its big blocks, so the pool is disabled
and every array is its own cudaMalloc. Exits non-zero if a result is wrong. A script next to the
test helpers it uses (run from the repository root after pip install -e .):
    compute-sanitizer --tool memcheck python tests/sanitize_cases.py [--only filled]
--only filled: just the decode cases on the unsplit wave, the filled and tail-split grids and with CTA loads
(a short run). --only variants: just the attention variants (window, softcap, ALiBi, dropout) on ragged
cases of every kernel family. --only varlen: packed ragged batches (zero-length sequences, one long one)
on the forward and backward of both kernel families, paged K/V in the varlen forward, and the KV-cache
extras (rotary, cache_batch_idx, cache_leftpad). --only hopper: the warp-specialized TMA forward
(sm_90a): every schedule on ragged dense cases, packed varlen with NaN past the used keys, paged K/V;
and the warp-specialized backward on ragged cases (a short run for memcheck, racecheck and synccheck:
mbarrier phases and named barriers). --only hopper-fwd, --only hopper-bwd: the forward or the backward part alone.
"""
import dataclasses
import sys

import cupy

cupy.cuda.set_allocator(None)
import numpy as np  # noqa: E402
from gpu_util import check_backward, check_forward, merge_policy, random_qkv  # noqa: E402
from test_decode_gpu import (  # noqa: E402
    FILLED_LAYOUT_CASE, FILLED_POLICY, TAIL_CASES, TAIL_LAYOUT_CASE, TAIL_POLICY, case, run_and_check,
)

from cuflash import jit, plan  # noqa: E402

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal, dtype, layout)
    (1, 77, 45, 2, 1, 64, True, "bf16", "bshd"),
    (2, 45, 77, 2, 2, 64, False, "fp16", "bhsd"),
    (1, 130, 130, 1, 1, 128, True, "bf16", "bshd"),
    (1, 33, 200, 2, 1, 128, False, "bf16", "bshd"),
    (1, 70, 70, 1, 1, 256, True, "fp16", "bshd"),
    (1, 50, 90, 1, 1, 100, True, "bf16", "bshd"),  # scalar-load path
    (1, 19, 23, 2, 2, 33, False, "fp16", "bshd"),  # scalar-load path
    (1, 200, 40, 1, 1, 160, True, "bf16", "bshd"),  # rows that see no key
]


def main():
    rng = np.random.default_rng(0)
    arch = jit.device_arch(0)
    filled_only = sys.argv[1:] == ["--only", "filled"]
    if sys.argv[1:] == ["--only", "variants"]:
        return variant_cases(rng, arch)
    if sys.argv[1:] == ["--only", "varlen"]:
        return varlen_cases(rng, arch)
    if sys.argv[1:] == ["--only", "hopper"]:
        return hopper_cases(rng, arch)
    if sys.argv[1:] == ["--only", "hopper-fwd"]:
        return hopper_cases(rng, arch, forward_only=True)
    if sys.argv[1:] == ["--only", "hopper-bwd"]:
        return hopper_bwd_cases(rng, arch)
    if sys.argv[1:] and not filled_only:
        sys.exit("usage: sanitize_cases.py [--only filled|variants|varlen|hopper|hopper-fwd|hopper-bwd]")
    for b, sq, sk, h, hk, d, causal, dt, layout in [] if filled_only else CASES:
        q, k, v = random_qkv(rng, b, sq, sk, h, hk, d, dt, layout_q=layout, layout_kv=layout)
        err, bound = check_forward(q, k, v, causal=causal, dtype=dt)
        print(f"ok fwd b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} {dt} {layout}: err {err:.2e} <= {bound:.2e}")
        if plan.uses_sm90_forward(d, True, arch):  # that ran the Hopper kernel: the mma.sync one too
            err, bound = check_forward(q, k, v, causal=causal, dtype=dt, tile=plan.fwd_tile(plan.head_dim_bucket(d), arch))
            print(f"ok fwd mma.sync kernel: err {err:.2e} <= {bound:.2e}")
        for deterministic in (False, True):
            errors = check_backward(q, k, v, causal=causal, dtype=dt, deterministic=deterministic)
            print(f"ok bwd deterministic={deterministic}: " + ", ".join(f"{n} {e:.2e} <= {bd:.2e}" for n, (e, bd) in errors.items()))
    # Decode: append + GQA + splits, the merge of many splits, a paged cache with 48-token pages and an empty sequence, the
    # element-wise path (head dim 100), causal speculative tokens.
    for kw, call in () if filled_only else (
        (dict(batch=2, seqlen_q=1, nheads=8, nheads_kv=2, head_dim=128, capacity=700, seqlen_new=3), dict(num_splits=4)),
        # The merge with 3 rows per kv head (2 warps per row, two rounds) and 64 splits of up to 4 rows
        # (more partial rows than one staged chunk holds).
        (dict(batch=2, seqlen_q=1, nheads=6, nheads_kv=2, head_dim=128, capacity=4200, lengths=[4200, 500]),
         dict(num_splits=64)),
        (dict(batch=1, seqlen_q=1, nheads=8, nheads_kv=2, head_dim=128, capacity=4200, lengths=[4200]),
         dict(num_splits=64)),
        # 5 rows (a warp per row, a second round of one row) with 70 splits (two staged chunks per row);
        # head dim 64 with one row (4 warps share it, rows of 64 floats in 128-column lanes).
        (dict(batch=1, seqlen_q=1, nheads=10, nheads_kv=2, head_dim=128, capacity=4480, lengths=[4480]),
         dict(num_splits=70)),
        (dict(batch=2, seqlen_q=1, nheads=2, nheads_kv=2, head_dim=64, capacity=2000, lengths=[2000, 700]),
         dict(num_splits=16)),
        (dict(batch=3, seqlen_q=1, nheads=4, nheads_kv=4, head_dim=64, capacity=300, page_size=48, lengths=[250, 0, 37]), {}),
        (dict(batch=2, seqlen_q=3, nheads=4, nheads_kv=1, head_dim=100, dtype="fp16", capacity=200, seqlen_new=3),
         dict(causal=True)),
        # Two and four slabs (the key columns of 2 and 4 warps sync on named barriers), and row blocks.
        (dict(batch=2, seqlen_q=1, nheads=32, nheads_kv=1, head_dim=128, capacity=900, lengths=[900, 130]),
         dict(num_splits=3)),
        (dict(batch=2, seqlen_q=3, nheads=64, nheads_kv=1, head_dim=64, capacity=700, lengths=[700, 0]),
         dict(causal=True, num_splits=2)),
    ):
        c = case(rng, **kw)
        for where in ("in kernel", "combine"):  # both merges of the splits (one split: neither runs)
            _, _, err, bound = run_and_check(**c, **call, policy=merge_policy(where))
            print(f"ok decode {kw} {call} merge {where}: err {err:.2e} <= {bound:.2e}")
    # The filled grid (one length for all; thresholds lowered so small caches take it, as in
    # tests/test_decode_gpu.py): long splits and a tail per group, split-major; causal GQA rows, a paged
    # cache with an append, long splits in 2 waves.
    made, real = [], plan.plan_decode
    plan.plan_decode = lambda **kw: made.append(real(**kw)) or made[-1]  # the plans the calls make
    # The lean combine kernel (forced) past one batch per warp: 384 output rows of 70 splits, 18 per
    # warp in 5 batches of 4, one sequence empty.
    if not filled_only:
        c = case(rng, batch=12, seqlen_q=1, nheads=32, nheads_kv=1, head_dim=128, capacity=4480,
                 lengths=[4480] * 11 + [0])  # fmt: skip
        _, _, err, bound = run_and_check(**c, num_splits=70, policy=merge_policy("combine", combine="lean"))
        if made[-1].combine is None or not made[-1].combine.spec.lean:
            sys.exit(f"decode b=12 h_kv=1 70 splits did not run the lean combine kernel ({made[-1].combine})")
        print(f"ok decode lean combine kernel, 384 rows x 70 splits: err {err:.2e} <= {bound:.2e}")
    # The unsplit wave (the plan's own thresholds; one whole group per SM, one length for all, sm_90+) on
    # a paged cache of 16-token pages (every 16-row column share of a tile in one page: the stepped
    # loads) with a ragged last tile (its per-row loads).
    if plan.supports_pdl(arch):
        num_sms = cupy.cuda.Device(0).attributes["MultiProcessorCount"]
        c = dict(case(rng, batch=num_sms, seqlen_q=1, nheads=4, nheads_kv=1, head_dim=128, capacity=4096,
                      page_size=16), cache_seqlens=4059)  # fmt: skip
        _, _, err, bound = run_and_check(**c)
        if (made[-1].num_splits, made[-1].ctas_per_sm) != (1, 1):
            sys.exit(f"decode b={num_sms} L=4059 h_kv=1 did not take the unsplit wave (grid {made[-1].attn.grid})")
        print(f"ok decode unsplit wave, paged P=16: err {err:.2e} <= {bound:.2e}")
    batch, nheads, nheads_kv, cached, capacity = FILLED_LAYOUT_CASE
    for kw, L, call in (
        (dict(batch=12, seqlen_q=1, nheads=8, nheads_kv=8, head_dim=128, capacity=920), 919, {}),
        (dict(batch=4, seqlen_q=2, nheads=16, nheads_kv=8, head_dim=128, capacity=3601), 3601, dict(causal=True)),
        (dict(batch=20, seqlen_q=2, nheads=16, nheads_kv=8, head_dim=128, capacity=4100), 4100, dict(causal=True)),
        (dict(batch=batch, seqlen_q=1, nheads=nheads, nheads_kv=nheads_kv, head_dim=64, capacity=capacity, page_size=48,
              seqlen_new=3), cached, {}),
    ):
        c = dict(case(rng, **kw), cache_seqlens=L)
        _, _, err, bound = run_and_check(**c, **call, policy=FILLED_POLICY)
        if not made[-1].split_major:
            sys.exit(f"decode {kw} L={L} did not take the filled grid on this GPU (grid {made[-1].attn.grid})")
        print(f"ok decode filled grid {kw} L={L} {call}: err {err:.2e} <= {bound:.2e}")
    # CTA loads (split CTAs spaced to 2 per SM) with two 16-row slabs, on both load paths.
    for head_dim in (128, 100):
        c = case(rng, batch=3, seqlen_q=2, nheads=32, nheads_kv=2, head_dim=head_dim, capacity=2000,
                 lengths=[1990, 0, 777])  # fmt: skip
        _, _, err, bound = run_and_check(**c, causal=True, num_splits=5, policy=dataclasses.replace(FILLED_POLICY,
                                                                                                       ctas_per_sm=2))
        if not made[-1].attn.spec.cta_loads:
            sys.exit(f"decode hd{head_dim} at 2 CTAs per SM did not load as a CTA ({made[-1].attn.spec.name})")
        print(f"ok decode CTA loads hd{head_dim}, 2 slabs: err {err:.2e} <= {bound:.2e}")
    # The tail-split grid (thresholds lowered as in tests/test_decode_gpu.py): column loads at 3 per SM,
    # CTA loads at 2 per SM, causal GQA with 12 packed rows x 5 splits, a paged cache with an append on
    # the element-wise path (head dim 100).
    batch, nheads, nheads_kv, cached, capacity = TAIL_LAYOUT_CASE
    for kw, L, call in [
        (dict(batch=b, seqlen_q=sq, nheads=h, nheads_kv=hk, head_dim=128, capacity=L + 7), L, dict(causal=causal))
        for b, h, hk, sq, causal, L in TAIL_CASES[:3]
    ] + [(dict(batch=batch, seqlen_q=1, nheads=nheads, nheads_kv=nheads_kv, head_dim=100, capacity=capacity,
               page_size=48, seqlen_new=3), cached + 3, {})]:  # fmt: skip
        c = dict(case(rng, **kw), cache_seqlens=L - kw.get("seqlen_new", 0))
        _, _, err, bound = run_and_check(**c, **call, policy=TAIL_POLICY)
        if not made[-1].tail_groups:
            sys.exit(f"decode {kw} L={L} did not take the tail-split grid on this GPU (grid {made[-1].attn.grid})")
        print(f"ok decode tail-split grid {kw} L={L} {call}: err {err:.2e} <= {bound:.2e}")
    cupy.cuda.runtime.deviceSynchronize()


def variant_cases(rng, arch):
    """Ragged cases of each variant (and all together, and a shifted diagonal) on the forward and
    backward of both kernel families, and on decode with splits."""
    import cuflash
    from cuflash import reference

    slopes = cupy.asarray(rng.uniform(0.05, 0.5, (2, 4)).astype(np.float32))
    variants = [dict(window_size=(0, 0)), dict(dropout_p=0.3),
                dict(window_size=(40, 3), softcap=5.0, alibi_slopes=slopes, dropout_p=0.2),
                dict(window_size=(30, 5), alibi_slopes=slopes, diag_shift=-20), dict(alibi_slopes=slopes, diag_shift=40)]
    for b, sq, sk, d, causal, layout in ((2, 77, 45, 64, True, "bshd"), (2, 45, 130, 128, False, "bhsd"),
                                         (2, 70, 70, 256, True, "bshd"), (2, 50, 90, 100, False, "bshd")):
        q, k, v = random_qkv(rng, b, sq, sk, 4, 2, d, "bf16", layout_q=layout, layout_kv=layout)
        bucket = plan.head_dim_bucket(d)
        for kw in variants:
            fwd_tiles = [None, plan.fwd_tile(bucket, arch)] if plan.uses_sm90_forward(d, True, arch) else [None]
            if plan.uses_sm90_ws_forward(d, True, arch):  # (short keys plan the short-key tile: the long keys' too)
                mods = plan.MOD_DROPOUT if "dropout_p" in kw else 0
                fwd_tiles.append(plan.ws_default_tile(bucket, mods))
            for tile in fwd_tiles:
                err, bound = check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile, **kw)
            bwd_tiles = [None, plan.bwd_tile(bucket, arch)]
            for tile in bwd_tiles:
                check_backward(q, k, v, causal=causal, dtype="bf16", tile=tile, **kw)
            print(f"ok variants {sorted(kw)} b={b} sq={sq} sk={sk} d={d} causal={causal}: fwd err {err:.2e} <= {bound:.2e}")
    for kw in (dict(window_size=(50, 0)), dict(softcap=10.0, alibi_slopes=slopes[0], window_size=(300, 0))):
        c = case(rng, batch=2, seqlen_q=2, nheads=4, nheads_kv=2, head_dim=128, capacity=700, lengths=[650, 3])
        for splits in (1, 4):
            out = cuflash.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], cache_seqlens=c["cache_seqlens"],
                                                 num_splits=splits, **kw)  # fmt: skip
            ref = reference.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"],
                                                   cache_seqlens=c["cache_seqlens"], **kw)[0]  # fmt: skip
            err = reference.max_abs_error(out, ref)
            if not err < 0.05:
                sys.exit(f"decode {kw} splits={splits}: error {err:.3g}")
            print(f"ok decode variants {sorted(kw)} splits={splits}: err {err:.2e}")
    cupy.cuda.runtime.deviceSynchronize()


def hopper_cases(rng, arch, forward_only=False):
    """The warp-specialized TMA forward: each schedule on ragged causal / windowed cases at 1, 3 and
    ragged key-tile counts, with and without clusters of 2 sharing K/V by multicast; the 3-warpgroup hd64
    tile; the persistent tiles, several tiles per CTA (O out by 16-byte stores and by TMA stores, whose
    shared-memory reads the next tile's staging waits for); partial last boxes; varlen NaN tails and paged
    K/V; the persistent packed walk over many items (spare slots, empty items); the TMA backward's ring depths, a
    window, variants and its varlen NaN tails."""
    if arch != "sm_90a":
        sys.exit("--only hopper needs an sm_90a GPU")
    from test_hopper_ws_gpu import persistent_varlen_case, test_varlen_nan_after_the_keys_stays_out

    W = plan.Sm90WsTile
    for tile in (W(128, 128, pingpong=False), W(128, 128), W(128, 128, overlap=False), W(128, 64, 3), W(192, 64),
                 W(128, 128, pingpong=False, cluster=2), W(128, 64, 3, cluster=2), W(192, 64, pingpong=False, cluster=2)):
        for sk, causal, kw in ((128, False, {}), (300, True, {}), (700, False, dict(window_size=(100, 30)))):
            q, k, v = random_qkv(rng, 2, 200, sk, 4, 2, 128, "bf16")
            err, bound = check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile, **kw)
            print(f"ok {tile} sk={sk} causal={causal} {kw}: err {err:.2e} <= {bound:.2e}")
    short = plan.FWD_SM90_WS_SHORT_TILES
    for d, tile in ((128, short[128]), (64, short[64]), (128, dataclasses.replace(short[128], tma_store=True)),
                    (128, dataclasses.replace(short[128], cluster=3 - short[128].cluster)),  # (with and without clusters)
                    (256, short[256])):  # (hd256's short-key tile: per-tile launches of 64-key tiles)
        # persistent: 4 x 5 x 16 = 320 tiles, so every CTA walks 2 or 3 of them (clusters: 5 tiles = 3 pairs,
        # the last with a CTA that only loads)
        for causal in (False, True):
            q, k, v = random_qkv(rng, 4, 600, 700, 16, 4, d, "bf16")
            err, bound = check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile)
            print(f"ok short-key {tile} d={d} causal={causal}: err {err:.2e} <= {bound:.2e}")
    # the paired causal walk past its whole double rounds: 9 query tiles x 64 pairs = 256 units on 132 CTAs (one
    # double round, 124 units left one tile per item, then 64 middle tiles); head dim 64 forced onto it
    for d in (128, 64):
        q, k, v = random_qkv(rng, 4, 1100, 1100, 16, 4, d, "bf16")
        tile = dataclasses.replace(short[d], paired=True)
        err, bound = check_forward(q, k, v, causal=True, dtype="bf16", tile=tile)
        print(f"ok paired walk {tile} d={d}: err {err:.2e} <= {bound:.2e}")
    # the look-ahead (the next item's first S under the epilogue, two Q slots): CTAs walk 2-6 items; causal with
    # more queries than keys and a window make items whose rows see no key (their stand-in S reads their Q);
    # a ring of 4 slots of 64 keys (the stand-in reads a Q tile with a key tile's strides)
    for d, tile in ((64, dataclasses.replace(short[64], look_ahead=True)), (128, dataclasses.replace(short[128], look_ahead=True)),
                    (128, plan.Sm90WsTile(128, 64, 4, pingpong=False, persistent=True, tma_store=False, look_ahead=True))):
        for sq, sk, causal, kw in ((600, 700, False, {}), (1400, 300, True, {}), (900, 700, False, dict(window_size=(40, 0)))):
            q, k, v = random_qkv(rng, 4, sq, sk, 16, 4, d, "bf16")
            err, bound = check_forward(q, k, v, causal=causal, dtype="bf16", tile=tile, **kw)
            print(f"ok look-ahead {tile} d={d} sq={sq} sk={sk} causal={causal} {kw}: err {err:.2e} <= {bound:.2e}")
    for d, dt in ((64, "fp16"), (56, "bf16"), (256, "bf16"), (248, "fp16")):  # planner's tiles, partial boxes
        q, k, v = random_qkv(rng, 1, 333, 257, 2, 1, d, dt)
        err, bound = check_forward(q, k, v, causal=True, dtype=dt)
        print(f"ok d={d} {dt}: err {err:.2e} <= {bound:.2e}")
    for d in (128, 256):
        test_varlen_nan_after_the_keys_stays_out(d)
        print(f"ok varlen NaN tails, paged, d={d}")
    for d in (64, 128):  # the persistent packed walk, ~15 items per CTA (spare slots, empty items)
        for causal in (False, True):
            err_o, err_lse = persistent_varlen_case(rng, d, causal)
            assert err_o <= 1e-2 and err_lse <= 1e-3, (err_o, err_lse)
            print(f"ok persistent varlen walk d={d} causal={causal}: out {err_o:.2e}, lse {err_lse:.2e}")
    if not forward_only:
        hopper_bwd_cases(rng, arch)


def hopper_bwd_cases(rng, arch):
    """The warp-specialized TMA backward alone (--only hopper-bwd, a short run for racecheck and synccheck)."""
    if arch != "sm_90a":
        sys.exit("--only hopper-bwd needs an sm_90a GPU")
    # the warp-specialized TMA backward: ring depths 2 and 3 over 1 and several query blocks, GQA,
    # a window, partial boxes, fp16, a variant with dropout; head dim 256's split consumers; the persistent grid
    B = plan.BwdSm90WsTile
    for tile, (sq, sk, d, dt, causal, kw) in (
        (B(), (64, 130, 128, "bf16", True, {})), (B(), (200, 300, 64, "fp16", False, {})),
        (B(stages=3), (300, 200, 120, "bf16", True, {})), (B(), (100, 900, 64, "bf16", True, dict(window_size=(50, 0)))),
        (B(), (150, 150, 128, "bf16", False, dict(softcap=5.0, dropout_p=0.2))),
        (B(block_n=64), (200, 150, 256, "bf16", True, {})), (B(block_n=64), (70, 130, 248, "fp16", False, {})),
        (B(block_n=64), (150, 200, 256, "bf16", False, dict(softcap=5.0, dropout_p=0.2, window_size=(60, 10)))),
        # persistent: 35 key blocks x 2 kv heads x 2 = 140 items > 132 SMs (CTAs walk 2); with a window most
        # items have no query block
        (B(persistent=True), (64, 4400, 128, "bf16", False, {})),
        (B(stages=3, persistent=True), (130, 4400, 64, "bf16", False, dict(window_size=(300, 0)))),
        (B(persistent=True), (700, 4400, 64, "fp16", True, {})),  # causal: 140 items, 8 from the counter
        # head dim 64's 128-row query blocks: dS^T in two atoms, each warpgroup's own dQ rows; a window, dropout;
        # head dim 128's 80-row ones: dQ^T and the transposed convert
        (B(block_m=128, stages=3), (300, 200, 64, "bf16", True, {})),
        (B(block_m=128), (130, 900, 56, "fp16", False, dict(window_size=(100, 0), dropout_p=0.2))),
        (B(block_m=128, persistent=True), (260, 4400, 64, "bf16", False, {})),
        (B(block_m=80), (300, 200, 128, "bf16", True, {})),
        (B(block_m=80), (170, 900, 120, "fp16", False, dict(window_size=(100, 0)))),
        (B(block_m=80, persistent=True), (170, 4400, 128, "bf16", False, {})),
    ):  # fmt: skip
        q, k, v = random_qkv(rng, 2, sq, sk, 4, 2, d, dt)
        check_backward(q, k, v, causal=causal, dtype=dt, tile=tile, rng=rng, **kw)
        print(f"ok backward {tile} sq={sq} sk={sk} d={d} {dt} causal={causal} {kw}")
    from test_hopper_ws_bwd_gpu import test_varlen_nan_past_the_sequences_stays_out

    test_varlen_nan_past_the_sequences_stays_out(64, True)  # packed: tiles past the sequences zeroed in smem
    test_varlen_nan_past_the_sequences_stays_out(256, False)
    print("ok backward varlen NaN tails")
    cupy.cuda.runtime.deviceSynchronize()


def varlen_cases(rng, arch):
    """Packed ragged batches: empty q and k sequences, one long sequence among short ones, GQA, causal or
    not, a window and the variants, deterministic dQ; forward and backward on the planner's kernel and
    the mma.sync one; each sequence against the reference (test_varlen_gpu's checks)."""
    from test_varlen_gpu import _check_seq_backward, _check_seq_forward, _cu, _packed

    from cuflash import varlen

    slopes = cupy.asarray(rng.uniform(0.05, 0.5, (6, 4)).astype(np.float32))
    lengths_q, lengths_k = [0, 3, 700, 0, 65, 1], [2, 0, 650, 0, 64, 130]
    for d, dt in ((128, "bf16"), (64, "fp16"), (256, "bf16"), (100, "bf16")):
        q = _packed(rng, lengths_q, 4, d, dt)
        k, v = _packed(rng, lengths_k, 2, d, dt), _packed(rng, lengths_k, 2, d, dt)
        cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
        bucket = plan.head_dim_bucket(d)
        for causal, kw in ((True, {}), (False, {}), (True, dict(window_size=(40, 0), softcap=5.0, alibi_slopes=slopes))):
            for fwd_tile, bwd_tile in ((None, None), (plan.fwd_tile(bucket, arch), plan.bwd_tile(bucket, arch))):
                out, lse = varlen.run(q, k, v, cu_q, cu_k, 700, 650, causal=causal, return_lse=True, tile=fwd_tile, **kw)
                _check_seq_forward(out, lse, q, k, v, cu_q, cu_k, causal=causal, scale=None, dtype=dt, what="", **kw)
                dout = cupy.asarray(rng.standard_normal(q.shape, dtype=np.float32).astype(out.dtype))
                for det in (False, True):
                    grads = varlen.run_backward(dout, q, k, v, out, lse, cu_q, cu_k, 700, 650, causal=causal,
                                                deterministic=det, tile=bwd_tile, **kw)  # fmt: skip
                    _check_seq_backward(grads, dout, q, k, v, out, cu_q, cu_k, causal=causal, scale=None, dtype=dt,
                                        what="", **kw)  # fmt: skip
            print(f"ok varlen d={d} {dt} causal={causal} {sorted(kw)}")
    # Paged K/V in the varlen forward (shuffled pages, unused table entries -1), both kernel families.
    from test_varlen_gpu import test_varlen_paged_matches_contiguous

    test_varlen_paged_matches_contiguous("plan", 128, 128)
    test_varlen_paged_matches_contiguous("mma.sync", 128, 96)
    print("ok paged varlen")
    # The KV-cache extras: rotary (both layouts) with new tokens on a paged cache, cache_batch_idx and
    # cache_leftpad (a whole sequence padded away) with splits.
    from test_kvcache_extras_gpu import test_cache_batch_idx, test_cache_leftpad, test_leftpad_of_a_whole_sequence, test_rotary

    for interleaved in (False, True):
        test_rotary(interleaved, True, True, 32)
    test_cache_batch_idx(False)
    test_cache_leftpad(4, "window")
    test_leftpad_of_a_whole_sequence()
    print("ok kvcache extras (rotary, cache_batch_idx, cache_leftpad)")
    cupy.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
