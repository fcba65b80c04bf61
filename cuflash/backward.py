"""The backward: ``cuflash.attention_backward``. Argument checks (cuflash/checks.py), buffers, the plan
(cuflash/plan/backward.py) and the three launches of cuda_src/flash_bwd.cuh (preprocess, main kernel,
dQ convert; on Hopper the main kernel of flash_bwd_sm90_ws.cuh with its tensor maps, cuflash/tma.py,
or of flash_bwd_sm90.cuh). The kernels assume what passes here.
"""
from __future__ import annotations

import functools
import math

from . import checks, jit, launch, plan, tma, variants
from .params import BWD_PACKER


def attention_backward(
    dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
    softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, rng_state=None,
    deterministic: bool = False, dq=None, dk=None, dv=None, diag_shift: int = 0,
):  # fmt: skip
    """Gradients (dq, dk, dv) of ``out = attention(q, k, v)`` given ``dout``, with FlashAttention-2.

    dout, out: (batch, seqlen_q, nheads, headdim) like q; out and lse are what
    ``cuflash.attention(q, k, v, causal=..., softmax_scale=..., return_lse=True)`` returned for
    these inputs (lse float32 (batch, nheads, seqlen_q), C-contiguous). q, k, v as in
    ``cuflash.attention``: float16 or bfloat16, any strides with a contiguous last dimension,
    GQA / MQA (dk, dv of a kv head are summed over its query heads), head dims 1 to 256.

    causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, diag_shift: the values the forward ran
    with; rng_state: the one the forward returned (with dropout_p > 0: required, it regenerates the
    forward's dropout mask).
    deterministic: False (default) adds the dq partial sums with fp32 atomics in whatever order the
    CTAs run (results may differ in the last bits between runs); True adds them in a fixed order
    (bitwise identical results run after run, somewhat slower; on Hopper head dims 64 and 128 keep
    the TMA kernel, other head dims run the mma.sync one).
    dq, dk, dv: optional outputs (shapes and dtypes of q, k, v, last dim contiguous) written in place.

    Runs on CuPy's current stream and never synchronizes. Extra device memory: an fp32 buffer of
    dq's size (rounded up to the head-dim bucket) and two fp32 values per query row.
    """
    return run(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
               softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng_state=rng_state,
               deterministic=deterministic, dq=dq, dk=dk, dv=dv, diag_shift=diag_shift)  # fmt: skip


def run(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
        softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, rng_state=None,
        deterministic: bool = False, dq=None, dk=None, dv=None,
        tile: plan.BwdTile | plan.BwdSm90Tile | plan.BwdSm90WsTile | None = None, diag_shift: int = 0):  # fmt: skip
    """``attention_backward`` with a forced main-kernel tile (a plan.BwdTile runs the mma.sync kernel
    with it, a plan.BwdSm90Tile the cp.async Hopper one, a plan.BwdSm90WsTile the warp-specialized
    TMA one); for tuning tools and tests. tile=None is exactly ``attention_backward``."""
    cupy = checks.cupy_module()
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, device_id = checks.check_qkv(q, k, v, cupy)
    softmax_scale = checks.resolve_scale(softmax_scale, head_dim)
    checks.check_like("dout", dout, "q", q, device_id, cupy)
    checks.check_like("out", out, "q", q, device_id, cupy)
    checks.check_lse(lse, (batch, nheads, seqlen_q), device_id, cupy)
    var = variants.resolve(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                           dropout_p=dropout_p, rng_state=rng_state, batch=batch, nheads=nheads, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, device_id=device_id, cupy=cupy, new_rng_state=False,
                           diag_shift=diag_shift)  # fmt: skip

    with cupy.cuda.Device(device_id):
        dq, dk, dv = (checks.output_like(given, like, device_id, cupy, name, name[1:])
                      for name, given, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)))  # fmt: skip
        grads = (dq, dk, dv)
        if batch == 0 or nheads == 0 or head_dim == 0:
            return grads
        if seqlen_q == 0 or seqlen_k == 0:  # no score at all: every gradient is 0
            for x in grads:
                x.fill(0)
            return grads

        aligned = head_dim % 8 == 0 and all(checks.aligned16(x) for x in (q, k, v, out, dout, dq, dk, dv))
        dtype = checks.DTYPE_NAMES[q.dtype]
        bp, fns, maps = load_with_maps(
            lambda t: _plan_and_load(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, var.causal, aligned,
                                     device_id, t, bool(deterministic), var.mods),
            q, k, v, dout, dtype, tile, bool(deterministic))  # fmt: skip
        main_tile = bp.main.spec.tile
        dq_tile = main_tile.warp_tiles(bp.dq_accum_cols)["dq"]
        rows = (batch, nheads, bp.seqlen_q_pad)
        # lse_log2 and D per row, then one int32: the persistent main kernel's item counter (zeroed by the
        # preprocess kernel), in one allocation (a pool call less per scratch array on the host path)
        n_rows = batch * nheads * bp.seqlen_q_pad
        row_scratch = cupy.empty(2 * n_rows + 1, dtype=cupy.float32)
        lse_log2, dsum = row_scratch[:n_rows].reshape(rows), row_scratch[n_rows : 2 * n_rows].reshape(rows)
        persistent = getattr(main_tile, "persistent", False)
        dq_accum = cupy.empty(rows + (bp.dq_accum_cols,), dtype=cupy.float32)  # (zeroed by the preprocess kernel)
        dq_turn = cupy.zeros((batch, nheads, bp.num_m_blocks), dtype=cupy.int32) if deterministic else None
        strides = {}
        for name, x in (("q", q), ("k", k), ("v", v), ("o", out), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
            for kind, s in zip(("batch", "row", "head"), checks.elem_strides(x)):
                strides[f"{name}_{kind}_stride"] = s
        record = BWD_PACKER.pack(
            q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, dout=dout.data.ptr, lse=lse.data.ptr,
            dq=dq.data.ptr, dk=dk.data.ptr, dv=dv.data.ptr, lse_log2=lse_log2.data.ptr, dsum=dsum.data.ptr,
            dq_accum=dq_accum.data.ptr, dq_turn=dq_turn.data.ptr if deterministic else 0,
            item_counter=row_scratch.data.ptr + 4 * 2 * n_rows if persistent else 0,
            **strides,
            batch=batch, nheads=nheads, nheads_kv=nheads_kv, head_ratio=nheads // nheads_kv,
            seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=head_dim, seqlen_q_pad=bp.seqlen_q_pad,
            dq_accum_cols=bp.dq_accum_cols, num_m_blocks=bp.num_m_blocks, deterministic=int(bool(deterministic)),
            block_m=main_tile.block_m, dq_q_warps=main_tile.dq_q_warps, dq_tile_rows=dq_tile[0], dq_tile_cols=dq_tile[1],
            pre_rows_per_warp=bp.pre_rows_per_warp,
            softmax_scale=softmax_scale, scale_log2=var.unit_scale(softmax_scale) * math.log2(math.e),
            mod=var.record(softmax_scale),
        )  # fmt: skip
        stream = cupy.cuda.get_current_stream().ptr
        launch.launch_record(fns[0], bp.pre, record, stream)
        launch.launch_record(fns[1], bp.main, maps + record, stream)
        launch.launch_record(fns[2], bp.convert, record, stream)
    return grads


def fallback_tile(bucket: int, deterministic: bool):
    """The main-kernel tile where no tensor map describes an input: the cp.async Hopper kernel, or the
    mma.sync one in deterministic mode (the cp.async kernel has no ordered dQ additions)."""
    return plan.bwd_tile(bucket, "sm_90a") if deterministic else plan.BWD_SM90_TILES[bucket]


def tma_maps(how, q, k, v, dout, dtype: str, forced: bool = False) -> bytes | None:
    """The tensor maps that start the warp-specialized main kernel's parameter block (BwdTmaParams), b""
    for the other kernels, None where the driver cannot describe an input with a tensor map (the
    caller then plans the cp.async Hopper kernel; with ``forced``, a tile the caller gave, the
    TensorMapError is raised)."""
    if how.spec.family != "flash_bwd_sm90_ws":
        return b""
    try:
        return tma.bwd_maps(q, k, v, dout, dtype, how.spec.tile.block_m, how.spec.tile.block_n)
    except tma.TensorMapError:
        if forced:
            raise
        return None


def load_with_maps(load, q, k, v, dout, dtype: str, tile, deterministic: bool):
    """Plan and kernels from ``load(tile)`` (a memoized plan-and-load of one call signature) and the
    tensor maps of the main kernel's parameter block (tma_maps): where no tensor map describes an
    input, plan again with fallback_tile (maps b""). Returns (plan, kernels, maps)."""
    bp, fns = load(tile)
    maps = tma_maps(bp.main, q, k, v, dout, dtype, forced=tile is not None)
    if maps is None:
        bp, fns = load(fallback_tile(bp.main.spec.head_dim, deterministic))
        maps = b""
    return bp, fns, maps


@functools.lru_cache(maxsize=1024)
def _plan_and_load(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, causal, aligned, device_id, tile,
                   deterministic, mods=0):  # fmt: skip
    """Plan and the three loaded kernels for one call signature (memoized, as in the forward)."""
    bp = plan.plan_backward(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_kv=nheads_kv, head_dim=head_dim,
        dtype=dtype, causal=causal, aligned=aligned, arch=jit.device_arch(device_id), tile=tile,
        deterministic=deterministic, mods=mods, sm_count=jit.device_sm_count(device_id),
    )  # fmt: skip
    return bp, tuple(jit.get_function(how.spec, device_id) for how in (bp.pre, bp.main, bp.convert))
