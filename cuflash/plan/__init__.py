"""Planning: shapes, dtype, flags and device facts -> which kernel variant runs, with which tile, grid
and shared memory. Pure Python (no CuPy, no GPU): everything here is testable on a CPU machine.

    common    head-dim buckets, dtypes, architectures and their limits, Launch, the kernel registry
    forward   plan_forward and the forward tiles (mma.sync and Hopper)
    backward  plan_backward and the backward tiles
    decode_kernels, decode
              the decode kernel variants; plan_decode and DecodePolicy (every decode tunable)

The JIT layer (cuflash/jit.py) turns a spec into source text and a compiled function; the API
modules (cuflash/forward.py, backward.py, kvcache.py) check arguments and call the planners.
"""
from .backward import (
    BWD_AUX_THREADS, BWD_FALLBACK_TILES, BWD_SM90_TILES, BWD_TILES, CONVERT_SMEM_ELEMS, BwdAuxSpec, BwdPlan,
    BwdSm90Spec, BwdSm90Tile, BwdSpec, BwdTile, all_bwd_specs, bwd_sm90_smem_bytes, bwd_sm90_spec, bwd_smem_bytes,
    bwd_spec, bwd_tile, plan_backward, uses_sm90_backward,
)
from .common import (
    ALL_MODS, DTYPES, HEAD_DIM_BUCKETS, KERNEL_FAMILIES, KNOWN_ARCHS, MAX_GRID_X, MAX_SMEM_KB, MIN_COMPUTE_CAPABILITY,
    MOD_ALIBI, MOD_DROPOUT, MOD_NAMES, MOD_SOFTCAP, MOD_VARLEN, MOD_WINDOW, FWD_BWD_MODS, SMEM_PER_SM_KB, KernelFamily, Launch, arch_for_capability, arch_number, head_dim_bucket, max_smem_bytes, parse_arch, smem_per_sm_bytes,
    supports_pdl,
)
from .decode import (
    DEFAULT_DECODE_POLICY, DecodePlan, DecodePolicy, all_decode_specs, decode_combine_lean, decode_cta_loads,
    decode_num_splits, decode_separate_combine, decode_tail_grid_variant, plan_decode,
)
from .decode_kernels import (
    DECODE_COMBINE_LEAN_BATCH, DECODE_COMBINE_LEAN_CTAS_PER_SM, DECODE_M_SLABS, DECODE_THREADS, DECODE_TILES,
    MAX_DECODE_SPLITS, DecodeAppendSpec, DecodeCombineSpec, DecodeSpec, DecodeTile, RotarySpec, decode_kv_row_elements,
    decode_launch_smem, decode_m_slabs, decode_m_slabs_options, decode_smem_bytes, decode_spec, decode_tile,
)
from .forward import (
    FWD_SM90_TILES, FWD_SM90_WS_SHORT_TILES, FWD_SM90_WS_TILES, FWD_TILES, KernelSpec, Sm90KernelSpec, Sm90Tile, Sm90WsKernelSpec, Sm90WsTile,
    Tile, all_fwd_specs, fwd_sm90_smem_bytes, fwd_sm90_spec, fwd_sm90_ws_smem_bytes, fwd_sm90_ws_spec, fwd_smem_bytes,
    fwd_spec, fwd_tile, plan_forward, sm90_ws_tile, uses_sm90_forward, uses_sm90_ws_forward, varlen_tiles, with_tile,
)

#: Each kernel family's variant list, as `cuflash precompile --kernels` selects them.
ALL_SPECS = {"fwd": all_fwd_specs, "bwd": all_bwd_specs, "decode": all_decode_specs}

__all__ = [
    "ALL_MODS",
    "MOD_ALIBI",
    "MOD_DROPOUT",
    "MOD_VARLEN",
    "FWD_BWD_MODS",
    "MOD_NAMES",
    "MOD_SOFTCAP",
    "MOD_WINDOW",
    "ALL_SPECS",
    "BWD_AUX_THREADS",
    "BWD_FALLBACK_TILES",
    "BWD_SM90_TILES",
    "BWD_TILES",
    "BwdAuxSpec",
    "BwdPlan",
    "BwdSm90Spec",
    "BwdSm90Tile",
    "BwdSpec",
    "BwdTile",
    "CONVERT_SMEM_ELEMS",
    "DECODE_COMBINE_LEAN_BATCH",
    "DECODE_COMBINE_LEAN_CTAS_PER_SM",
    "DECODE_M_SLABS",
    "DECODE_THREADS",
    "DECODE_TILES",
    "DEFAULT_DECODE_POLICY",
    "DTYPES",
    "DecodeAppendSpec",
    "RotarySpec",
    "DecodeCombineSpec",
    "DecodePlan",
    "DecodePolicy",
    "DecodeSpec",
    "DecodeTile",
    "FWD_SM90_TILES",
    "FWD_SM90_WS_TILES",
    "FWD_SM90_WS_SHORT_TILES",
    "sm90_ws_tile",
    "FWD_TILES",
    "HEAD_DIM_BUCKETS",
    "KERNEL_FAMILIES",
    "KNOWN_ARCHS",
    "KernelFamily",
    "KernelSpec",
    "Launch",
    "MAX_DECODE_SPLITS",
    "MAX_GRID_X",
    "MAX_SMEM_KB",
    "MIN_COMPUTE_CAPABILITY",
    "SMEM_PER_SM_KB",
    "Sm90KernelSpec",
    "Sm90Tile",
    "Sm90WsKernelSpec",
    "Sm90WsTile",
    "Tile",
    "all_bwd_specs",
    "all_decode_specs",
    "all_fwd_specs",
    "arch_for_capability",
    "arch_number",
    "bwd_sm90_smem_bytes",
    "bwd_sm90_spec",
    "bwd_smem_bytes",
    "bwd_spec",
    "bwd_tile",
    "decode_combine_lean",
    "decode_cta_loads",
    "decode_kv_row_elements",
    "decode_launch_smem",
    "decode_m_slabs",
    "decode_m_slabs_options",
    "decode_num_splits",
    "decode_separate_combine",
    "decode_smem_bytes",
    "decode_spec",
    "decode_tail_grid_variant",
    "decode_tile",
    "fwd_sm90_smem_bytes",
    "fwd_sm90_spec",
    "fwd_sm90_ws_smem_bytes",
    "fwd_sm90_ws_spec",
    "fwd_smem_bytes",
    "fwd_spec",
    "fwd_tile",
    "head_dim_bucket",
    "max_smem_bytes",
    "parse_arch",
    "plan_backward",
    "plan_decode",
    "plan_forward",
    "smem_per_sm_bytes",
    "supports_pdl",
    "uses_sm90_backward",
    "uses_sm90_forward",
    "uses_sm90_ws_forward",
    "varlen_tiles",
    "with_tile",
]
