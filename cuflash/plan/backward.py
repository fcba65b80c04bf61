"""Backward planning: the three launches of one backward call (preprocess, main kernel, dQ convert;
cuda_src/flash_bwd.cuh and, on Hopper, the main kernel of cuda_src/flash_bwd_sm90.cuh), their tiles,
grids and shared memory. Pure Python: testable on a CPU machine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .common import (
    DTYPES, HEAD_DIM_BUCKETS, MOD_DROPOUT, MOD_SOFTCAP, MOD_VARLEN, HopperSpec, Launch, SpecBase, TiledSpec, arch_tag, check_dtype, cpp_bool,
    check_mods, head_dim_bucket, load_tag, max_smem_bytes, mods_arg,
)  # fmt: skip


@dataclass(frozen=True)
class BwdTile:
    """Tile shape of one backward main-kernel variant (see BWD_TILES for the reasons).

    Each of the kernel's three phases spreads its output over the warps as a grid (BwdConfig in
    cuda_src/flash_bwd.cuh): S^T (block_n x block_m) with s_key_warps warps along the keys, dK/dV
    (block_n x d) with kv_key_warps along the keys, dQ (block_m x d) with dq_q_warps along the queries;
    the other factor of ``warps`` runs along the second dimension.
    """

    block_m: int  # query rows per iteration
    block_n: int  # keys per CTA
    warps: int
    stages: int  # buffers of the query-side tiles (Q, dO, lse, D): 2 = next block prefetched
    s_key_warps: int
    kv_key_warps: int
    dq_q_warps: int
    min_blocks: int = 1  # __launch_bounds__ minimum CTAs per SM
    dq_transposed = False  # (the convert kernel's dQ tiles are query rows x head-dim columns)

    def warp_tiles(self, head_dim_bucket: int) -> dict[str, tuple[int, int]]:
        """(rows, columns) of one warp's tile in each phase."""
        w, d = self.warps, head_dim_bucket
        return {
            "scores": (self.block_n // self.s_key_warps, self.block_m // (w // self.s_key_warps)),
            "dkdv": (self.block_n // self.kv_key_warps, d // (w // self.kv_key_warps)),
            "dq": (self.block_m // self.dq_q_warps, d // (w // self.dq_q_warps)),
        }

    def valid_for(self, head_dim_bucket: int) -> bool:
        """The layout rules BwdConfig static_asserts (whole 16-row slabs, 16-column pairs, full grids)."""
        if self.stages not in (1, 2) or self.block_m % 16 or self.block_m // 2 > 32 * self.warps:
            return False
        if self.block_m * (head_dim_bucket + 8) > CONVERT_SMEM_ELEMS:  # the dQ convert stages one tile
            return False
        if any(self.warps % x for x in (self.s_key_warps, self.kv_key_warps, self.dq_q_warps)):
            return False
        for phase, (rows, cols) in self.warp_tiles(head_dim_bucket).items():
            if rows < 16 or rows % 16 or cols < 16 or cols % 16:
                return False
        return True

    def registers(self, head_dim_bucket: int) -> dict[str, int]:
        """fp32 accumulator registers per thread: dK + dV (live all along), S^T + dP^T, dQ."""
        tiles = self.warp_tiles(head_dim_bucket)
        per_thread = lambda rc: rc[0] * rc[1] // 32  # noqa: E731
        return {"dkdv": 2 * per_thread(tiles["dkdv"]), "scores": 2 * per_thread(tiles["scores"]),
                "dq": per_thread(tiles["dq"])}  # fmt: skip


#: Backward tiles per head-dim bucket. Warp tiles of R x C elements read (R + C) * 32 bytes of
#: shared memory per 16-deep k-step for R * C / 128 MMAs, and mma.sync on Hopper is fed faster than
#: shared memory can deliver 16-row tiles: the layouts aim for 32-row tiles in every phase. Registers
#: per thread ~ dK + dV accumulators (kept all along) + S^T and dP^T (BwdTile.registers). Shared
#: memory = 2 * (2 * block_n + 2 * stages * block_m) * (d + 8) + 4 * block_n * (block_m + 8) +
#: 8 * stages * block_m bytes (K, V, Q, dO, P^T, dS^T, lse, D).
BWD_TILES: dict[int, BwdTile] = {
    # 128 keys x 128 queries (FA2's hd64 shape): scores 32 x 64, dK/dV 32 x 32 (hd64), dQ 32 x 32.
    32: BwdTile(128, 128, 8, 2, s_key_warps=4, kv_key_warps=4, dq_q_warps=4),
    64: BwdTile(128, 128, 8, 2, s_key_warps=4, kv_key_warps=4, dq_q_warps=4),
    # 128 keys x 64 queries (FA2's hd128 shape): scores 32 x 32, dK/dV 32 x 64 (128 regs), dQ 32 x 32.
    96: BwdTile(64, 128, 8, 2, s_key_warps=4, kv_key_warps=4, dq_q_warps=4),  # dQ 16 x 48 (48 / 4 splits)
    128: BwdTile(64, 128, 8, 2, s_key_warps=4, kv_key_warps=4, dq_q_warps=2),
    # 64 keys x 64 queries: dK/dV at most 128 regs; hd160 / hd224 split the head dim in halves of
    # 80 / 112 columns (quarters would not be whole 16-column pairs).
    160: BwdTile(64, 64, 8, 2, s_key_warps=2, kv_key_warps=4, dq_q_warps=4),
    192: BwdTile(64, 64, 8, 2, s_key_warps=2, kv_key_warps=2, dq_q_warps=2),
    224: BwdTile(64, 64, 8, 2, s_key_warps=2, kv_key_warps=4, dq_q_warps=4),
    256: BwdTile(64, 64, 8, 2, s_key_warps=2, kv_key_warps=2, dq_q_warps=2),
}

#: Threads of the preprocess / convert kernels (one warp per query row / one CTA per query block).
BWD_AUX_THREADS = 256
#: Elements of the convert kernel's smem tile (flash_bwd.cuh kConvertSmemElems): every backward
#: tile's block_m * (bucket + 8) must fit.
CONVERT_SMEM_ELEMS = 64 * (256 + 8)


def bwd_smem_bytes(head_dim_bucket: int, tile: BwdTile) -> int:
    """Dynamic shared memory of the backward main kernel: must match BwdConfig::kSmemBytes."""
    stride = head_dim_bucket + 8
    kv, q, pp = tile.block_n * stride, tile.block_m * stride, tile.block_n * (tile.block_m + 8)
    return 2 * (2 * kv + 2 * tile.stages * q + 2 * pp) + 4 * 2 * tile.stages * tile.block_m


#: Smaller tiles for GPUs with less shared memory (tried in order; compile-tested only).
BWD_FALLBACK_TILES = (
    BwdTile(64, 64, 4, 1, s_key_warps=2, kv_key_warps=2, dq_q_warps=2),
    BwdTile(32, 32, 4, 1, s_key_warps=2, kv_key_warps=2, dq_q_warps=2),
)


def bwd_tile(bucket: int, arch: str) -> BwdTile:
    """The backward tile for ``bucket`` on ``arch``: the BWD_TILES row, or where that needs more shared
    memory than the arch has, its single-buffered form, then BWD_FALLBACK_TILES (untuned)."""
    t = BWD_TILES[bucket]
    limit = max_smem_bytes(arch)
    for c in (t, dataclasses.replace(t, stages=1)) + BWD_FALLBACK_TILES:
        if bwd_smem_bytes(bucket, c) <= limit and c.valid_for(bucket) and c.registers(bucket)["dkdv"] <= 128:
            return c
    raise ValueError(f"no backward tile for head dim {bucket} fits the {limit // 1024} KB of shared memory of {arch}")


@dataclass(frozen=True)
class BwdSpec(TiledSpec):
    """One backward main-kernel variant."""

    head_dim: int  # bucket
    dtype: str
    causal: bool
    aligned: bool
    tile: BwdTile
    arch: str
    family: str = "flash_bwd"
    mods: int = 0  # attention variants (common.MOD_* bits)

    @property
    def name(self) -> str:
        t = self.tile
        return self._variant_name(f"_s{t.s_key_warps}kv{t.kv_key_warps}dq{t.dq_q_warps}")

    @property
    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        t, b = self.tile, cpp_bool
        return (
            f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.warps}, {b(self.dtype == 'bf16')}, {b(self.causal)}, "
            f"{b(self.aligned)}, {t.stages}, {t.s_key_warps}, {t.kv_key_warps}, {t.dq_q_warps}{mods_arg(self.mods)}"
        )


@dataclass(frozen=True)
class BwdAuxSpec(SpecBase):
    """The preprocess (D, lse_log2) or dQ-convert kernel: one warp per row, any head dim."""

    family: str  # "flash_bwd_pre" | "flash_bwd_convert"
    dtype: str
    aligned: bool
    arch: str
    varlen: bool = False  # packed sequences (cuda_src/varlen.cuh): rows through the tile scheduler
    transposed: bool = False  # (convert) the main kernel's dQ tiles are dQ^T (BwdSm90WsTile.dq_transposed)

    @property
    def name(self) -> str:
        return (f"{self.family}_{self.dtype}{'_varlen' if self.varlen else ''}{'_dqT' if self.transposed else ''}"
                f"_{load_tag(self.aligned)}_{arch_tag(self.arch)}")  # fmt: skip

    threads = BWD_AUX_THREADS
    min_blocks = 1
    smem_bytes = 0

    def template_args(self) -> str:
        # (a plain variant's source stays what it was)
        tail = f", {cpp_bool(self.varlen)}, true" if self.transposed else (", true" if self.varlen else "")
        return f"{cpp_bool(self.dtype == 'bf16')}, {cpp_bool(self.aligned)}{tail}"


class _Sm90DqLayout:
    """The dQ tile layout both Hopper backward kernels add in (what the convert kernel reads): 4 warps
    of 16 query rows x one head-dim half per (consumer) warpgroup."""

    dq_transposed = False

    @property
    def dq_q_warps(self) -> int:
        return 4

    def warp_tiles(self, head_dim_bucket: int) -> dict[str, tuple[int, int]]:
        return {"dq": (16, head_dim_bucket // 2)}


@dataclass(frozen=True)
class BwdSm90Tile(_Sm90DqLayout):
    """Tile of the Hopper (wgmma) backward main kernel (cuda_src/flash_bwd_sm90.cuh): two warpgroups,
    query blocks of 64 rows, and block_n keys per CTA: 128 (one warpgroup per 64 keys) or 64 (the
    warpgroups split the work and the head dim, for d = 256)."""

    block_n: int = 128
    block_m: int = 64
    stages: int = 2
    min_blocks: int = 1

    @property
    def warps(self) -> int:
        return 8


#: Hopper backward tiles. dK + dV accumulators of 64 keys x d per warpgroup take d registers per
#: thread: d <= 128 gives each warpgroup its own 64 keys; d = 256 splits the head dim between the
#: warpgroups instead (64 keys per CTA). Other buckets run the mma.sync kernel.
BWD_SM90_TILES: dict[int, BwdSm90Tile] = {64: BwdSm90Tile(), 128: BwdSm90Tile(), 256: BwdSm90Tile(block_n=64)}


@dataclass(frozen=True)
class BwdSm90WsTile(_Sm90DqLayout):
    """Tile of the warp-specialized Hopper backward (cuda_src/flash_bwd_sm90_ws.cuh): query blocks of
    ``block_m`` rows (64; 128 at head dim 64, where each consumer warpgroup's dQ part is its 64 rows and
    not a head-dim half; 80 at head dim 128, where it is dQ^T, its head-dim half x the 80 rows), ``block_n``
    keys per CTA (128: one consumer warpgroup per 64 keys; 64 for head dim 256: the consumer warpgroups
    split the keys of S and the head dim of dK, dV, dQ), and a producer warpgroup that issues TMA loads
    into a ring of ``stages`` query-block slots."""

    block_n: int = 128
    block_m: int = 64
    stages: int = 2
    min_blocks: int = 1
    # One CTA per SM walks the key blocks (plain batches, head dims 64 and 128, atomic dQ): the next key
    # block's K, V and first query blocks load under this one's last blocks and dK / dV stores (plan_backward)
    persistent: bool = False

    @property
    def warps(self) -> int:
        return 12  # a producer warpgroup and two consumer warpgroups

    @property
    def dq_transposed(self) -> bool:
        return self.block_m == 80  # dQ^T: tiles of 16 head-dim rows x 80 query columns

    @property
    def dq_q_warps(self) -> int:
        # warp w of the consumers: rows 16 (w % 4) (64 rows), 16 w (128 rows), head-dim rows 16 w (80: dQ^T)
        return 4 if self.block_m == 64 else 8

    def warp_tiles(self, head_dim_bucket: int) -> dict[str, tuple[int, int]]:
        d = head_dim_bucket
        return {"dq": (16, {64: d // 2, 128: d, 80: 80}[self.block_m])}


#: Warp-specialized Hopper backward tiles: the default backward main kernel on sm_90a for aligned
#: calls of these buckets, packed (varlen) batches and deterministic mode included (softcap calls at
#: head dim 64 run 64-row query blocks: bwd_sm90_ws_tile).
#: Measured on the H200 (tools/tune_bwd.py --sm90, bf16, 1k / 4k / 16k x causal, TFLOP/s): 3 stages
#: 1.00-1.05x 2 stages at head dim 64; at 128, 0.96-1.03x (2 stages kept: 45 KB less shared memory).
#: Head dim 256 fits 2 stages only (226 KB). Head dim 64's 128-row query blocks (BWD_SM90_WS_WIDE_ROWS),
#: on an H100 (tools/tune_bwd.py --sm90 --block-m 64 128, bf16, 512-16k tokens x causal, one run with cuDNN
#: and FA2): 1.01-1.04x the 64-row blocks non-causal, 1.07-1.16x causal (median 1.077 of cuDNN against
#: 0.998), 3 stages ahead of 2. Head dim 128's 80 rows lost in the same session (0.95-0.97x the planned grids
#: causal, 0.92x at 512 tokens and 1.00-1.02x beyond non-causal): not planned. On the H200 (tools/ablation.py,
#: docs/results/ablation-h200.json): hd64's 128 rows 1.06x the 64-row blocks; hd128's 80 rows 1.02-1.06x
#: non-causal, 0.95-1.04x causal, and 0.912-0.916 of cuDNN against 0.923-0.937 over 512-16k x causal.
BWD_SM90_WS_TILES: dict[int, BwdSm90WsTile] = {
    64: BwdSm90WsTile(block_m=128, stages=3), 128: BwdSm90WsTile(), 256: BwdSm90WsTile(block_n=64),
}


#: The warp-specialized backward's wide query blocks, rows per head-dim bucket (FlashAttention-3's tiles: 128
#: at head dim 64, 80 at 128, dQ^T there), beside the 64 rows of every bucket (tools/tune_bwd.py --block-m).
BWD_SM90_WS_WIDE_ROWS: dict[int, int] = {64: 128, 128: 80}


#: Where the planner runs the warp-specialized backward persistent (one CTA per SM taking items from a
#: counter), by (head dim bucket, kernel causal flag). Measured on the H200 against the per-key-block grid
#: (tools/ab_sources.py, bf16, 512 / 1024 / 2048 / 8192 / 16384 tokens, 16k tokens per batch, two rounds; the
#: ratio of the rounds' means per length): hd128 non-causal 1.00-1.04 (median 1.01; the same kernel in two
#: trees measured 0.985-1.015), and in one run against cuDNN (tools/tune_bwd.py --persistent) 0.92-0.93 of
#: cuDNN at 512-4096 tokens against 0.89-0.90 per key block. Left out: causal calls, 0.93-1.03 at hd128 and
#: 0.96-0.99 at hd64 (their short items pay the counter and the hand-over; a static order measured 1.04-1.10
#: at hd64 but left hd128 at 16k tokens 0.70x, docs/history/hopper.md, sessions 20-22); hd64 non-causal,
#: 0.94-0.98 (static order); again in session 23, with the counter and with its number taken one item ahead:
#: hd128 causal 8-16k 0.90-0.95, hd64 non-causal 0.92-0.95 (so the atomic's latency is not the cost). Calls with a variant (window, softcap, ALiBi, dropout) keep the per-key-block grid
#: too: none was measured persistent, windowed items are short and uneven as causal ones (causal windows reach
#: the planner as kernel-causal False with MOD_WINDOW), and the persistent softcap build spills 8 bytes where
#: the per-key-block one spills none.
BWD_SM90_WS_PERSISTENT: frozenset[tuple[int, bool]] = frozenset({(128, False)})


def bwd_sm90_ws_tile(bucket: int, causal: bool, mods: int, sm_count: int | None,
                     deterministic: bool = False) -> BwdSm90WsTile:
    """The warp-specialized backward's tile for a call: BWD_SM90_WS_TILES[bucket] (64-row query blocks for
    softcap), persistent where
    BWD_SM90_WS_PERSISTENT lists (bucket, causal) (``causal``: the kernel's flag, after the variants' resolve),
    for non-deterministic plain batches without a variant (``mods`` == 0) when the GPU's SM count is known. Its CTAs
    start with items 0 .. G - 1 of the per-key-block grid's order and then take the next item from a counter
    (zeroed by the preprocess), so items of unequal length go to whichever CTA frees up first, as the
    hardware's block scheduler hands out the per-key-block grid. Deterministic mode keeps one CTA per key
    block: a persistent CTA's later item waits for the turn of an item that another CTA of the grid holds,
    which is safe only if the whole grid is resident at once, and a GPU shared with other work (another
    stream, MPS, a sanitizer) does not promise that."""
    tile = BWD_SM90_WS_TILES[bucket]
    if tile.block_m != 64 and mods & MOD_SOFTCAP:  # (bwd_sm90_ws_spec says why)
        tile = dataclasses.replace(tile, block_m=64)
    if (not mods and not deterministic and sm_count
            and (bucket, bool(causal)) in BWD_SM90_WS_PERSISTENT):  # fmt: skip
        return dataclasses.replace(tile, persistent=True)
    return tile


def bwd_sm90_ws_smem_bytes(head_dim_bucket: int, tile: BwdSm90WsTile) -> int:
    """Must match Sm90WsBwdConfig::kSmemBytes: 1 KB alignment, K, V, stages x (Q, dO), 2 x dS^T (and,
    64-key split tile, 2 x P^T), stages x (lse_log2, D), 2 + 2 x stages mbarriers; persistent: the item
    ring's 4 mbarriers and 2 items of 16 bytes (with 8 bytes for their alignment)."""
    d, n, m, st = head_dim_bucket, tile.block_n, tile.block_m, tile.stages
    ds_tiles = 2 if n == 64 else 1
    ring = 8 * 4 + 8 + 32 if tile.persistent else 0
    ds_bytes = n * 128 * -(-m // 64)  # dS^T in 64-query atoms (80 queries: two)
    return 1024 + 2 * n * d * 2 + 2 * st * m * d * 2 + 2 * ds_tiles * ds_bytes + st * 2 * m * 4 + 8 * (2 + 2 * st) + ring


@dataclass(frozen=True)
class BwdSm90WsSpec(HopperSpec):
    """One warp-specialized Hopper backward main-kernel variant (TMA, wgmma, sm_90a, atomic dQ)."""

    tile: BwdSm90WsTile
    family: str = "flash_bwd_sm90_ws"

    @property
    def name(self) -> str:
        return self._variant_name("_persistent" if self.tile.persistent else "")

    @property
    def smem_bytes(self) -> int:
        return bwd_sm90_ws_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        b = cpp_bool
        t = self.tile
        # (the 64-row tiles' arguments stay what they were before block_m was one: the same sources and cubins)
        tail = f", {b(t.persistent)}, {t.block_m}" if t.block_m != 64 else (f", {b(True)}" if t.persistent else "")
        return f"{self.head_dim}, {b(self.dtype == 'bf16')}, {b(self.causal)}, {self.mods}, {t.stages}{tail}"


def bwd_sm90_ws_spec(head_dim: int, dtype: str, causal: bool, tile: BwdSm90WsTile | None = None,
                     mods: int = 0) -> BwdSm90WsSpec:  # fmt: skip
    bucket = head_dim_bucket(head_dim)
    check_dtype(dtype)
    if bucket not in BWD_SM90_WS_TILES:
        raise ValueError(f"no warp-specialized backward tile for head-dim bucket {bucket} (have {sorted(BWD_SM90_WS_TILES)})")
    tile = tile or bwd_sm90_ws_tile(bucket, causal, mods, None)
    if (tile.block_n != (64 if bucket == 256 else 128) or tile.block_m not in (64, BWD_SM90_WS_WIDE_ROWS.get(bucket, 64))
            or not 2 <= tile.stages <= 4 or tile.min_blocks != 1):  # fmt: skip
        raise ValueError("the warp-specialized backward runs 128 keys (64 for head dim 256) x 64 queries, 2 to 4 "
                         f"stages, min_blocks 1 (or x 128 queries at head dim 64, x 80 at 128); got {tile}")  # fmt: skip
    if tile.block_m == 80 and mods & MOD_DROPOUT:
        raise ValueError("the warp-specialized backward's 80-row query blocks with dropout leave ptxas short of "
                         "registers (it serializes every wgmma): dropout calls run 64-row blocks")  # fmt: skip
    if tile.block_m != 64 and mods & MOD_SOFTCAP:
        raise ValueError(f"the warp-specialized backward's {tile.block_m}-row query blocks derive dV's P^T from dS^T's, "
                         "which softcap multiplies by 1 - tanh^2: softcap calls run 64-row blocks")  # fmt: skip
    if tile.persistent and (bucket == 256 or mods & MOD_VARLEN):
        raise ValueError("the persistent warp-specialized backward runs head dims 64 and 128 on plain batches "
                         f"(not packed ones); got head dim {head_dim}, mods {mods}")  # fmt: skip
    if bwd_sm90_ws_smem_bytes(bucket, tile) > max_smem_bytes("sm_90a"):
        raise ValueError(f"tile {tile} needs {bwd_sm90_ws_smem_bytes(bucket, tile)} bytes of shared memory")
    return BwdSm90WsSpec(bucket, dtype, bool(causal), tile, mods=check_mods(mods))


def uses_sm90_ws_backward(head_dim: int, aligned: bool, arch: str) -> bool:
    """True when the backward's main kernel is the warp-specialized TMA one: sm_90a, 16-byte rows, a
    bucket of BWD_SM90_WS_TILES (plain or packed batches, atomic or deterministic dQ alike: the kernel
    orders its dQ additions by turn counters in deterministic mode)."""
    return arch == "sm_90a" and aligned and head_dim % 8 == 0 and head_dim_bucket(head_dim) in BWD_SM90_WS_TILES


def bwd_sm90_smem_bytes(head_dim_bucket: int, tile: BwdSm90Tile) -> int:
    """Must match Sm90BwdConfig::kSmemBytes: K, V, 2 x (Q, dO), dS^T, the fp32 P^T exchange of the
    split (64-key) kernel, 2 x (lse_log2, D), 1 KB alignment."""
    d, n, m = head_dim_bucket, tile.block_n, tile.block_m
    exchange = n * (m + 4) * 4 if n == 64 else 0
    return 1024 + 2 * n * d * 2 + 4 * m * d * 2 + n * m * 2 + exchange + 2 * 2 * m * 4


@dataclass(frozen=True)
class BwdSm90Spec(HopperSpec):
    """One Hopper backward main-kernel variant (sm_90a, 16-byte loads, atomic dQ)."""

    tile: BwdSm90Tile
    family: str = "flash_bwd_sm90"

    @property
    def smem_bytes(self) -> int:
        return bwd_sm90_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        b = cpp_bool
        return f"{self.head_dim}, {self.tile.block_n}, {b(self.dtype == 'bf16')}, {b(self.causal)}{mods_arg(self.mods)}"


def uses_sm90_backward(head_dim: int, aligned: bool, arch: str, deterministic: bool) -> bool:
    """True when the backward's main kernel is the Hopper one: sm_90a, 16-byte loads, a bucket of
    BWD_SM90_TILES, and atomic dQ (deterministic mode runs the mma.sync kernel's ordered additions)."""
    return (arch == "sm_90a" and aligned and not deterministic and head_dim % 8 == 0
            and head_dim_bucket(head_dim) in BWD_SM90_TILES)  # fmt: skip


def bwd_pre_rows_per_warp(head_dim: int, aligned: bool) -> int:
    """Query rows per warp of the backward's preprocess (flash_bwd_pre_kernel): on the 16-byte path
    about one 16-byte chunk of O and of dO per lane (lanes per row: ceil(head_dim / 8) rounded up to
    a power of two, 4 to 32), so that every lane has loads in flight; element-wise: a row per warp.
    Always 1, 2, 4 or 8 (a divisor of every block_m, so a warp's rows stay in one query tile)."""
    if not aligned:
        return 1
    lanes = 4
    while lanes < 32 and lanes * 8 < head_dim:
        lanes *= 2
    return 32 // lanes


@dataclass(frozen=True)
class BwdPlan:
    pre: Launch
    main: Launch
    convert: Launch
    seqlen_q_pad: int  # rows of the lse_log2 / D / dq_accum buffers per (batch, head)
    dq_accum_cols: int  # columns of dq_accum (the head-dim bucket)
    num_m_blocks: int  # query blocks per (batch, head); varlen: the scheduler's query tiles per head
    pre_rows_per_warp: int = 1  # the preprocess's rows per warp (BwdParams.pre_rows_per_warp)


def bwd_spec(head_dim: int, dtype: str, causal: bool, aligned: bool, arch: str, tile: BwdTile | None = None,
             mods: int = 0) -> BwdSpec:
    bucket = head_dim_bucket(head_dim)
    check_dtype(dtype)
    if aligned and head_dim % 8 != 0:
        raise ValueError("the 16-byte load path needs head_dim % 8 == 0")
    tile = tile or bwd_tile(bucket, arch)
    if not tile.valid_for(bucket):
        raise ValueError(f"tile {tile} breaks the backward kernel's warp layout rules for head dim {bucket}")
    if bwd_smem_bytes(bucket, tile) > max_smem_bytes(arch):
        raise ValueError(
            f"tile {tile} needs {bwd_smem_bytes(bucket, tile)} bytes of shared memory; {arch} allows {max_smem_bytes(arch)}"
        )
    return BwdSpec(bucket, dtype, bool(causal), bool(aligned), tile, arch, mods=check_mods(mods))


def plan_backward(
    *,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    nheads: int,
    nheads_kv: int,
    head_dim: int,
    dtype: str,
    causal: bool,
    aligned: bool,
    arch: str,
    tile: BwdTile | BwdSm90Tile | BwdSm90WsTile | None = None,
    deterministic: bool = False,
    mods: int = 0,
    sm_count: int | None = None,
) -> BwdPlan:
    """The three launches of one backward call (all sizes >= 1). The main kernel is the Hopper one
    where uses_sm90_backward says so (or a BwdSm90Tile is given), else the mma.sync one. With
    MOD_VARLEN, batch is the number of packed sequences and seqlen_q / seqlen_k the packed totals: the
    grids run over the tile scheduler's slots (cuda_src/varlen.cuh), the scratch rows per head are
    the query slots times block_m, and batch is 1 in every grid. ``sm_count`` (the GPU's SMs) lets the
    planner pick the persistent warp-specialized backward (bwd_sm90_ws_tile), whose grid is one CTA per SM
    (at most one per key block)."""
    varlen = bool(mods & MOD_VARLEN)
    if min(batch, seqlen_q, nheads, nheads_kv) < 1 or seqlen_k < (0 if varlen else 1):
        raise ValueError("plan_backward needs non-empty dimensions; empty inputs never launch")
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if isinstance(tile, BwdSm90WsTile) or (tile is None and uses_sm90_ws_backward(head_dim, aligned, arch)):
        if arch != "sm_90a" or not aligned or head_dim % 8:
            raise ValueError("the warp-specialized backward needs sm_90a and 16-byte aligned inputs")
        if tile is None:
            tile = bwd_sm90_ws_tile(head_dim_bucket(head_dim), causal, mods, sm_count, deterministic)
        if tile.persistent and not sm_count:
            raise ValueError("a persistent backward tile needs sm_count (the GPU's multiprocessors)")
        if tile.persistent and deterministic:
            raise ValueError("deterministic=True runs the per-key-block backward (its ordered dQ additions wait "
                             "across CTAs); pass a tile without persistent=True")
        spec = bwd_sm90_ws_spec(head_dim, dtype, causal, tile, mods)
    elif isinstance(tile, BwdSm90Tile) or (tile is None and uses_sm90_backward(head_dim, aligned, arch, deterministic)):
        if arch != "sm_90a" or not aligned or deterministic or head_dim % 8:
            raise ValueError("the Hopper backward kernel needs sm_90a, 16-byte aligned inputs and deterministic=False")
        spec = bwd_sm90_spec(head_dim, dtype, causal, tile, mods)
    else:
        spec = bwd_spec(head_dim, dtype, causal, aligned, arch, tile, mods)
    bm, bn = spec.tile.block_m, spec.tile.block_n
    if varlen:
        from .forward import varlen_tiles

        num_m_blocks, grid_batch = varlen_tiles(seqlen_q, batch, bm), 1
        key_blocks = varlen_tiles(seqlen_k, batch, bn)
    else:
        num_m_blocks, grid_batch = -(-seqlen_q // bm), batch
        key_blocks = -(-seqlen_k // bn)
    seqlen_q_pad = num_m_blocks * bm
    rpw = bwd_pre_rows_per_warp(head_dim, aligned)
    rows_per_cta = BWD_AUX_THREADS // 32 * rpw
    aux_block = (BWD_AUX_THREADS, 1, 1)
    pre = Launch(BwdAuxSpec("flash_bwd_pre", dtype, aligned, arch, varlen), (-(-seqlen_q_pad // rows_per_cta), nheads, grid_batch),
                 aux_block, 0)  # fmt: skip
    if getattr(spec.tile, "persistent", False):  # one CTA per SM (at most one per item) walks the key blocks
        main = Launch(spec, (min(key_blocks * nheads_kv * grid_batch, sm_count), 1, 1), (spec.threads, 1, 1), spec.smem_bytes)
    else:
        main = Launch(spec, (key_blocks, nheads_kv, grid_batch), (spec.threads, 1, 1), spec.smem_bytes)
    # One CTA per query block (its dQ tile is staged in CONVERT_SMEM_ELEMS of smem: BwdTile.valid_for).
    convert = Launch(BwdAuxSpec("flash_bwd_convert", dtype, aligned, arch, varlen, spec.tile.dq_transposed),
                     (num_m_blocks, nheads, grid_batch), aux_block, 0)  # fmt: skip
    return BwdPlan(pre, main, convert, seqlen_q_pad, spec.head_dim, num_m_blocks, rpw)


def bwd_sm90_spec(head_dim: int, dtype: str, causal: bool, tile: BwdSm90Tile | None = None, mods: int = 0) -> BwdSm90Spec:
    bucket = head_dim_bucket(head_dim)
    check_dtype(dtype)
    if bucket not in BWD_SM90_TILES:
        raise ValueError(f"no Hopper backward tile for head-dim bucket {bucket} (have {sorted(BWD_SM90_TILES)})")
    tile = tile or BWD_SM90_TILES[bucket]
    if tile.block_n != (64 if bucket == 256 else 128) or tile.block_m != 64 or tile.stages != 2:
        raise ValueError(
            f"the Hopper backward kernel runs 128 keys (64 for head dim 256) x 64 queries, 2 stages; got {tile}"
        )
    return BwdSm90Spec(bucket, dtype, bool(causal), tile, mods=check_mods(mods))


def all_bwd_specs(arch: str, head_dims=HEAD_DIM_BUCKETS, dtypes=DTYPES, causals=(False, True), aligned=(True, False),
                  mods=(0,)):  # fmt: skip
    """Every backward variant (main, preprocess, convert) for ``arch``; on sm_90a also the Hopper main
    kernel for the aligned variants of its buckets. ``mods``: the variant combinations to include."""
    specs: list = []
    for dt in dtypes:
        for al in aligned:
            for vl in dict.fromkeys(bool(m & MOD_VARLEN) for m in mods):
                specs += [BwdAuxSpec("flash_bwd_pre", dt, al, arch, vl), BwdAuxSpec("flash_bwd_convert", dt, al, arch, vl)]
            for d in head_dims:
                bucket = head_dim_bucket(d)
                for c in causals:
                    for m in mods:
                        specs.append(BwdSpec(bucket, dt, c, al, bwd_tile(bucket, arch), arch, mods=m))
                        if al and uses_sm90_backward(bucket, True, arch, False):
                            specs.append(bwd_sm90_spec(bucket, dt, c, mods=m))
                        if al and uses_sm90_ws_backward(bucket, True, arch):
                            specs.append(bwd_sm90_ws_spec(bucket, dt, c, bwd_sm90_ws_tile(bucket, c, m, None), m))
                            planned = bwd_sm90_ws_tile(bucket, c, m, sm_count=1)
                            if planned.persistent:  # (with the GPU's SM count the planner takes it)
                                specs.append(bwd_sm90_ws_spec(bucket, dt, c, planned, m))
    return list(dict.fromkeys(specs))
