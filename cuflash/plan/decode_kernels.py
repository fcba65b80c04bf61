"""Decode kernel variants: the split-KV kernel's tiles, shared memory and specs, and the specs of the
combine and append kernels (cuda_src/flash_decode*.cuh). How a call is cut into splits and grids is
cuflash/plan/decode.py. Pure Python: testable on a CPU machine."""
from __future__ import annotations

from dataclasses import dataclass

from .common import (
    MOD_ALIBI, MOD_SOFTCAP, MOD_WINDOW, SpecBase, arch_tag, check_dtype, check_mods, cpp_bool, head_dim_bucket, load_tag,
    max_smem_bytes, mods_arg, mods_tag, smem_per_sm_bytes,
)  # fmt: skip

#: Every decode kernel runs 4 warps (cuda_src/decode_common.cuh: kDecodeThreads).
DECODE_THREADS = 128
#: 16-row slabs of packed query rows (group * seqlen_q rows of one kv head) per CTA. A CTA of m slabs
#: arranges its 4 warps as m slab rows x 4 / m key columns, so every warp holds one 16-row slab.
DECODE_M_SLABS = (1, 2, 4)
#: Most key splits per sequence (kDecodeMaxSplits: the merge loads every lse of a chunk in one batch).
MAX_DECODE_SPLITS = 128
#: The lean combine kernel (DecodeCombineSpec): partial rows each warp loads at once, and the CTAs
#: per SM its ~52 registers a thread allow (its __launch_bounds__ minimum).
DECODE_COMBINE_LEAN_BATCH = 4
DECODE_COMBINE_LEAN_CTAS_PER_SM = 8


@dataclass(frozen=True)
class DecodeTile:
    """K/V tiling of one split-KV variant (see DECODE_TILES for the reason of each row)."""

    block_n: int  # keys per K/V tile, shared by the CTA's warps (each key column of warps takes an equal part)
    stages: int  # K/V tiles in the cp.async ring: stages - 1 in flight while one is used
    min_blocks: int  # CTAs per SM the shared memory is sized for (__launch_bounds__ minimum)


#: Split-KV tiles per head-dim bucket (Hopper: 227 KB per CTA, 228 KB per SM). Decode streams the
#: cache once, so the rows are about bytes in flight: at ~4.5 TB/s and ~1 us of loaded latency an
#: SM needs ~35 KB of loads outstanding; every row keeps >= 2 tiles (>= 32 KB) in flight per CTA.
#: K/V rows are unpadded (XOR-swizzled chunks) where the bucket is a multiple of 64, else padded by 8
#: elements (decode_kv_row_elements). Shared memory = 2 * 16 * m_slabs * (d + 8) (Q) + 512 (m, l) +
#: 4 * stages * block_n * kv_row (K and V stages). Registers per thread: O 16 * d / 32 + S
#: block_n * m_slabs / 8 (FA2's per-warp steps on one 16-row slab). hd128 swept on the H200
#: (docs/history/decode.md); the other rows follow the same bytes-in-flight reasoning, untuned.
DECODE_TILES: dict[int, DecodeTile] = {
    # 20 KB stages of 128 keys (a K tile is 8 KB): 4 stages = 82 KB, 2 CTAs/SM, 96 KB in flight per SM.
    32: DecodeTile(128, 4, 2),
    # 16 KB stages of 64 keys: 4 stages = 66 KB, 2 CTAs/SM, 96 KB in flight per SM.
    64: DecodeTile(64, 4, 2),
    # 27 KB stages: 3 stages = 80 KB, 2 CTAs/SM.
    96: DecodeTile(64, 3, 2),
    # 32 KB stages: 2 stages (69 KB with Q) at 3 CTAs/SM. KV TB/s vs cuDNN, median of 9 shapes:
    # 2 stages x 3 CTAs 0.988, 3 x 2 0.982, 4 x 1 0.874, 128-key tiles 2 x 1 0.761.
    128: DecodeTile(64, 2, 3),
    # 43 KB stages: 2 stages (86 KB) keep 2 CTAs/SM, 86 KB in flight per SM.
    160: DecodeTile(64, 2, 2),
    # 48 KB stages: 2 stages (99 KB), 2 CTAs/SM.
    192: DecodeTile(64, 2, 2),
    # 59 KB stages: 2 would not fit twice per SM; 3 stages (178 KB) at 1 CTA/SM, 119 KB in flight.
    224: DecodeTile(64, 3, 1),
    # 64 KB stages (66 KB padded, with more than one slab): 3 stages (<= 203 KB) at 1 CTA/SM.
    256: DecodeTile(64, 3, 1),
}


def decode_kv_row_elements(head_dim_bucket: int, m_slabs: int) -> int:
    """Elements per K/V smem row of the split-KV kernel (DecodeConfig::kKVStride): unpadded, with
    XOR-swizzled 16-byte chunks, where the bucket is whole 128-byte groups (except hd256 with more
    than one slab, which would spill); padded by 8 otherwise."""
    swizzled = head_dim_bucket % 64 == 0 and not (head_dim_bucket == 256 and m_slabs > 1)
    return head_dim_bucket if swizzled else head_dim_bucket + 8


def decode_smem_bytes(head_dim_bucket: int, m_slabs: int, tile: DecodeTile) -> int:
    """Dynamic shared memory of the split-KV kernel: must match DecodeConfig::kSmemBytes."""
    stride = head_dim_bucket + 8
    kv_stride = decode_kv_row_elements(head_dim_bucket, m_slabs)
    warps_n = 4 // m_slabs
    q = 2 * 16 * m_slabs * stride
    ml = 2 * 4 * warps_n * 16 * m_slabs
    pipe = 2 * 2 * tile.stages * tile.block_n * kv_stride
    merge = 4 * warps_n * 16 * m_slabs * stride  # fp32 merge of the warp columns, over the K/V stages
    return q + ml + max(pipe, merge)


def _decode_fits(bucket: int, m_slabs: int, tile: DecodeTile, arch: str) -> bool:
    smem = decode_smem_bytes(bucket, m_slabs, tile)
    return smem <= max_smem_bytes(arch) and tile.min_blocks * (smem + 1024) <= smem_per_sm_bytes(arch)


def decode_launch_smem(spec_smem: int, ctas_per_sm: int, arch: str) -> int:
    """Dynamic shared memory to launch the split kernel with so that at most ``ctas_per_sm`` of its
    CTAs are resident per SM: the kernel's own ``spec_smem``, padded up to a whole ``ctas_per_sm``-th
    of the SM's shared memory (less the 1 KB the driver reserves per CTA) when that holds fewer CTAs
    than the kernel's size would. The padding is never touched; it only spaces the CTAs out."""
    if ctas_per_sm < 1:
        raise ValueError(f"ctas_per_sm must be >= 1, got {ctas_per_sm}")
    share = min(smem_per_sm_bytes(arch) // ctas_per_sm - 1024, max_smem_bytes(arch))
    return max(spec_smem, share)


def decode_tile(bucket: int, m_slabs: int, arch: str) -> DecodeTile:
    """The split-KV tile for ``bucket`` and ``m_slabs`` on ``arch``: the DECODE_TILES row, or where its
    CTAs do not fit min_blocks per SM, fewer stages (down to 2), then fewer CTAs per SM with the
    row's stages and down to a single stage (untuned on those GPUs). ValueError if nothing fits."""
    t = DECODE_TILES[bucket]
    for mb in range(t.min_blocks, 0, -1):
        for st in range(t.stages, 0 if mb == 1 else 1, -1):
            c = DecodeTile(t.block_n, st, mb)
            if _decode_fits(bucket, m_slabs, c, arch):
                return c
    raise ValueError(
        f"no decode tile for head dim {bucket} with {16 * m_slabs}-row CTAs fits the shared memory of {arch}"
    )


def decode_m_slabs_options(bucket: int, arch: str) -> tuple[int, ...]:
    """The slab counts whose CTAs fit ``arch`` for ``bucket`` (all of DECODE_M_SLABS on sm_80 / sm_90)."""
    out = []
    for m in DECODE_M_SLABS:
        try:
            decode_tile(bucket, m, arch)
        except ValueError:
            continue
        out.append(m)
    return tuple(out)


@dataclass(frozen=True)
class DecodeSpec(SpecBase):
    """One split-KV attention variant (the causal mask is a run-time flag: it costs one compare per tile)."""

    head_dim: int  # bucket
    dtype: str
    aligned: bool  # 16-byte cp.async loads (else element-wise loads for odd head dims / strides)
    m_slabs: int  # 16-row slabs of packed query rows per CTA
    tile: DecodeTile
    arch: str
    cta_loads: bool = False  # the CTA loads each K/V tile together (else each key column of warps its rows)
    tail_grid: bool = False  # the tail-split grid's 1-D CTA mapping (plan/decode.py _tail_split), else the split grids'
    family: str = "flash_decode"
    mods: int = 0  # attention variants (common.MOD_* bits; window, softcap, ALiBi)

    @property
    def name(self) -> str:
        t = self.tile
        return (
            f"{self.family}_hd{self.head_dim}_{self.dtype}_ms{self.m_slabs}_bn{t.block_n}_st{t.stages}"
            f"_mb{t.min_blocks}{'_cta' if self.cta_loads else ''}{'_tail' if self.tail_grid else ''}"
            f"{mods_tag(self.mods)}_{load_tag(self.aligned)}_{arch_tag(self.arch)}"
        )

    threads = DECODE_THREADS

    @property
    def min_blocks(self) -> int:
        return self.tile.min_blocks

    @property
    def smem_bytes(self) -> int:
        return decode_smem_bytes(self.head_dim, self.m_slabs, self.tile)

    @property
    def launch_smem_limit(self) -> int:
        """Split-KV launches may be padded (decode_launch_smem) up to the GPU's per-CTA maximum."""
        return max_smem_bytes(self.arch)

    def template_args(self) -> str:
        """C++ template argument list of cuflash::DecodeConfig for this variant."""
        t, b = self.tile, cpp_bool
        return (f"{self.head_dim}, {t.block_n}, {self.m_slabs}, {t.stages}, {b(self.dtype == 'bf16')}, {b(self.aligned)}, "
                f"{b(self.cta_loads)}, {b(self.tail_grid)}{mods_arg(self.mods)}")


class _DecodeHelperKernel(SpecBase):
    """Launch shape of the decode helper kernels (append, combine): 4 warps, static shared memory only,
    no CTAs-per-SM target."""

    threads = DECODE_THREADS
    min_blocks = 1
    smem_bytes = 0


@dataclass(frozen=True)
class DecodeAppendSpec(_DecodeHelperKernel):
    """The in-place append of new tokens into the cache: dtype-free 2-byte copies, any head dim."""

    aligned: bool  # 16-byte copies (else element-wise)
    arch: str
    family: str = "flash_decode_append"

    @property
    def name(self) -> str:
        return f"{self.family}_{load_tag(self.aligned)}_{arch_tag(self.arch)}"

    def template_args(self) -> str:
        return cpp_bool(self.aligned)


@dataclass(frozen=True)
class RotarySpec(_DecodeHelperKernel):
    """Rotary position embedding of a decode call's query or new key tokens (cuda_src/rotary.cuh)."""

    dtype: str
    interleaved: bool  # GPT-J pairs (2i, 2i + 1); else GPT-NeoX pairs (i, i + rotary_dim / 2)
    arch: str
    family: str = "rotary"

    @property
    def name(self) -> str:
        return f"{self.family}_{self.dtype}_{'interleaved' if self.interleaved else 'halves'}_{arch_tag(self.arch)}"

    def template_args(self) -> str:
        return f"{cpp_bool(self.dtype == 'bf16')}, {cpp_bool(self.interleaved)}"


@dataclass(frozen=True)
class DecodeCombineSpec(_DecodeHelperKernel):
    """The merge of the splits' partial rows as a kernel of its own: one CTA per output row. Wide: each
    warp loads up to 32 (hd > 128: 16) of its splits at once; lean: DECODE_COMBINE_LEAN_BATCH, at
    DECODE_COMBINE_LEAN_CTAS_PER_SM CTAs per SM (plan/decode.py decode_combine_lean picks)."""

    head_dim: int  # bucket (floats per partial row)
    dtype: str
    arch: str
    lean: bool = False
    family: str = "flash_decode_combine"

    @property
    def name(self) -> str:
        return f"{self.family}_hd{self.head_dim}_{self.dtype}{'_lean' if self.lean else ''}_{arch_tag(self.arch)}"

    @property
    def min_blocks(self) -> int:
        return DECODE_COMBINE_LEAN_CTAS_PER_SM if self.lean else 1

    @property
    def splits_in_flight(self) -> int:
        """Partial rows each warp loads at once (the kernel's kBatch)."""
        return DECODE_COMBINE_LEAN_BATCH if self.lean else 32 // -(-self.head_dim // 128)

    def template_args(self) -> str:
        return f"{self.head_dim}, {cpp_bool(self.dtype == 'bf16')}, {self.splits_in_flight}"


def decode_spec(head_dim: int, dtype: str, aligned: bool, m_slabs: int, arch: str, mods: int = 0) -> DecodeSpec:
    bucket = head_dim_bucket(head_dim)
    check_dtype(dtype)
    if aligned and head_dim % 8 != 0:
        raise ValueError("the 16-byte load path needs head_dim % 8 == 0")
    if m_slabs not in DECODE_M_SLABS:
        raise ValueError(f"m_slabs must be one of {DECODE_M_SLABS}, got {m_slabs}")
    return DecodeSpec(bucket, dtype, bool(aligned), m_slabs, decode_tile(bucket, m_slabs, arch), arch,
                      mods=check_mods(mods, MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI))


def decode_m_slabs(rows: int, bucket: int, arch: str) -> int:
    """Fewest slabs that hold ``rows`` packed query rows in one CTA, else the most that fit ``arch``
    (the rows are then spread over row blocks, which read the same K/V through L2)."""
    options = decode_m_slabs_options(bucket, arch)
    if not options:
        raise ValueError(f"no decode tile for head dim {bucket} fits the shared memory of {arch}")
    return next((m for m in options if 16 * m >= rows), options[-1])
