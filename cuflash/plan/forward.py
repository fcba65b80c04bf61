"""Forward planning: shapes, dtype, flags and arch -> the kernel variant, its tile, grid and shared
memory (cuda_src/flash_fwd.cuh, the mma.sync kernel; cuda_src/flash_fwd_sm90.cuh, the Hopper one).
Pure Python: testable on a CPU machine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .common import (
    DTYPES, HEAD_DIM_BUCKETS, MOD_DROPOUT, MOD_VARLEN, HopperSpec, Launch, TiledSpec, check_dtype, check_mods, cpp_bool,
    ctas_per_sm_by_smem, head_dim_bucket, max_smem_bytes, mods_arg,
)  # fmt: skip


@dataclass(frozen=True)
class Tile:
    """Tile shape of one forward variant (see FWD_TILES for the reason of each choice)."""

    block_m: int  # query rows per CTA
    block_n: int  # key rows per K/V tile
    warps: int  # warps per CTA; each owns block_m / warps query rows
    q_in_regs: bool  # Q MMA fragments held in registers for the whole loop (else re-read from smem)
    min_blocks: int  # __launch_bounds__ minimum CTAs per SM (caps registers per thread)
    stages: int = 2  # smem buffers per K and per V tile: 2 = double buffered, 1 = FA2's single buffer


#: Forward tiles per head-dim bucket, one row each, with the reason (tuned on the H200 with
#: tools/tune_fwd.py; ratios are against torch's FA2, median of 6 grid points; docs/history/forward.md).
#: Register budget per thread ~ O accumulator (rows_per_warp * d / 32) + S accumulator
#: (rows_per_warp * block_n / 32) + Q fragments if q_in_regs (rows_per_warp * d / 64).
#: Shared memory = 2 * (block_m + 2 * stages * block_n) * (d + 8) bytes (Q + stages x (K, V)); KiB below.
FWD_TILES: dict[int, Tile] = {
    # 32 rows/warp: O 32 + S 128 + Q 16 regs; single-buffered 128-key tiles, 2 CTAs/SM (1.07x).
    32: Tile(128, 128, 4, True, 2, stages=1),
    # 32 rows/warp: O 64 + S 64 + Q 32 regs; single buffer (36 KiB) beat double (54 KiB; 0.99x vs 0.93x).
    64: Tile(128, 64, 4, True, 2, stages=1),
    # 32 rows/warp: O 96 + S 64 regs, Q re-read from smem; single buffer (0.85x vs 0.81x).
    96: Tile(128, 64, 4, False, 2, stages=1),
    # FA2's tile: 32 rows/warp, O 128 + S 64 regs, Q from smem, 2 CTAs/SM (102 KiB); double
    # buffering 0.95x against 0.94x single, 0.87x for 32-key tiles. (Where two 102 KiB CTAs do not fit
    # an SM, as on the A100, fwd_tile takes the single-buffered 68 KiB form.)
    128: Tile(128, 64, 4, False, 2, stages=2),
    # 32 rows/warp with 32-key tiles: O 160 + S 32 regs fits; 63 KiB single buffer, 2 CTAs/SM (1.17x;
    # 8 warps of 16 rows 1.01x).
    160: Tile(128, 32, 4, False, 2, stages=1),
    # 8 warps of 16 rows: O 96 + S 32 + Q 48 regs, 150 KiB double buffer, 1 CTA/SM (0.78x; 64x64 of 4 warps 0.75x).
    192: Tile(128, 64, 8, True, 1, stages=2),
    # 8 warps of 16 rows: O 112 + S 32 regs, Q from smem, 174 KiB, 1 CTA/SM (0.99x; 64x64 of 4 warps 0.76x).
    224: Tile(128, 64, 8, False, 1, stages=2),
    # Torch's FA2 tile for 256: 4 warps of 16 rows, single buffer (99 KiB) so 2 CTAs/SM (0.93x, against
    # 0.82x for 128x64 of 8 warps double buffered at 1 CTA/SM).
    256: Tile(64, 64, 4, False, 2, stages=1),
}


def fwd_smem_bytes(head_dim_bucket: int, tile: Tile) -> int:
    """Dynamic shared memory of the forward kernel: must match FwdConfig::kSmemBytes."""
    stride = head_dim_bucket + 8
    return 2 * (tile.block_m * stride + 2 * tile.stages * tile.block_n * stride)


@dataclass(frozen=True)
class Sm90Tile:
    """Tile shape of one Hopper (wgmma) forward variant: 64 query rows per warpgroup of 4 warps."""

    block_m: int  # query rows per CTA (block_m / 64 warpgroups)
    block_n: int  # key rows per K/V tile (the N of S = Q K^T)
    stages: int = 2  # smem buffers per K and per V tile
    min_blocks: int = 1  # __launch_bounds__ minimum CTAs per SM

    @property
    def warps(self) -> int:
        return self.block_m // 16


#: Hopper forward tiles (cuda_src/flash_fwd_sm90.cuh) per head-dim bucket; buckets not listed (and
#: unaligned inputs) run the mma.sync kernel. Registers per thread ~ O (d / 2) + S (block_n / 2) + P
#: fragments (block_n / 4). Shared memory = 1024 + 2 * (block_m + 2 * stages * block_n) * d bytes.
#: The loader needs threads % (d / 8) == 0 with 8 | threads / (d / 8), so d = 192 waits for a
#: 3-warpgroup tile. Tuned on the H200 with tools/tune_fwd.py --sm90 (median ratio to torch's FA2
#: over 1k/4k/16k, causal and not, bf16).
FWD_SM90_TILES: dict[int, Sm90Tile] = {
    # 2 warpgroups x 64-key tiles: O 32 + S 32 regs, 50 KB (1.30x; 128-key tiles 1.09x, 192-row CTAs 1.14x).
    64: Sm90Tile(128, 64),
    # 2 warpgroups x 128-key tiles: O 64 + S 64 regs, 161 KB, 1 CTA/SM (1.34x; 64-key tiles 1.13x,
    # 3 warpgroups x 64 keys 1.24x).
    128: Sm90Tile(128, 128),
    # 2 warpgroups x 64-key tiles: O 128 + S 32 regs, 193 KB, 1 CTA/SM (1.55x; the only shape that fits).
    256: Sm90Tile(128, 64),
}


def fwd_sm90_smem_bytes(head_dim_bucket: int, tile: Sm90Tile) -> int:
    """Dynamic shared memory of the Hopper forward kernel: must match Sm90FwdConfig::kSmemBytes."""
    return 1024 + 2 * (tile.block_m + 2 * tile.stages * tile.block_n) * head_dim_bucket


@dataclass(frozen=True)
class Sm90WsTile:
    """Tile and schedule of the warp-specialized Hopper forward (cuda_src/flash_fwd_sm90_ws.cuh):
    block_m / 64 consumer warpgroups of 64 query rows plus one producer warpgroup that issues the
    TMA loads into a ring of ``stages`` K/V slots."""

    block_m: int  # query rows per CTA: 128 (2 consumer warpgroups) or 192 (3)
    block_n: int  # key rows per K/V tile
    stages: int = 2  # K/V slots of the load ring
    overlap: bool = True  # a tile's softmax overlaps the previous tile's P V (inside a warpgroup)
    pingpong: bool = True  # two consumer warpgroups take turns at the tensor cores (block_m 128 only)
    min_blocks: int = 1
    persistent: bool = False  # one CTA per SM walks the tiles (the next tile's loads overlap an epilogue)
    tma_store: bool = True  # O leaves by TMA stores, one per warp's rows (packed batches: 16-byte stores, fwd_sm90_ws_spec)
    # CTAs per thread-block cluster: 2 = two query tiles of one (head, batch) share every K/V tile, each CTA
    # loading half its rows into both (TMA multicast), which halves the K/V the L2 serves (plain batches only:
    # packed ones get 1, fwd_sm90_ws_spec)
    cluster: int = 1
    # (persistent, overlapped, 128 rows, no ping-pong, no clusters; plain batches: packed ones get False, fwd_sm90_ws_spec)
    # each consumer warpgroup issues the next item's first S = Q K^T right after this item's last P V, so that
    # it runs under the epilogue; Q takes two slots (the next item's loads while this one's is read)
    look_ahead: bool = False
    # (persistent, causal, plain batches, no clusters) the walk takes query tiles u and m - 1 - u of a (head,
    # batch) pair back to back, so that each CTA's share of the causal work is even (False: every grid-stride
    # tile in the group order, whose mix of heavy and light tiles depends on the stride and the L2 group size)
    paired: bool = True

    @property
    def warps(self) -> int:
        return 4 * (self.block_m // 64 + 1)

    @property
    def sched(self) -> int:
        """The kernel's kSched bits (flash_fwd_sm90_ws.cuh): 1 overlap, 2 ping-pong, 4 persistent, 8 TMA store,
        16 clusters of 2, 32 look-ahead, 64 the paired walk (persistent only)."""
        return (int(self.overlap) | (2 if self.pingpong and self.block_m == 128 else 0) | (4 if self.persistent else 0)
                | (8 if self.tma_store else 0) | (16 if self.cluster == 2 else 0)
                | (32 if self.look_ahead else 0) | (64 if self.persistent and self.paired else 0))  # fmt: skip


#: Warp-specialized Hopper forward tiles per head-dim bucket: the default forward on sm_90a for
#: aligned inputs of these buckets. Registers per consumer thread ~ O (d / 2) + S (block_n / 2) +
#: P of the previous tile (block_n / 4), within 240 (2 consumer warpgroups) or 160 (3). Tuned on the
#: H200 with tools/tune_fwd.py --ws (bf16, median over 1k/4k/16k x causal, ratios to cuDNN; the
#: ping-pong schedule measured 0.02 slower at every bucket, so it is off; docs/history/hopper.md).
FWD_SM90_WS_TILES: dict[int, Sm90WsTile] = {
    # 3 consumer warpgroups x 128-key tiles: 0.969 (2 warpgroups 0.879, with ping-pong 0.875; 64-key tiles 0.740)
    64: Sm90WsTile(192, 128, pingpong=False),
    # 3 warpgroups x 80-key tiles (1.5x the query rows per K/V byte of 128 x 128): once the softmax overlapped
    # P V (session 17; tuned on its first build, whose per-warp branch synccheck rejected), 1.02-1.04x 128 x 128
    # at 4k-16k keys non-causal, 1.00-1.02x causal (TFLOP/s at 16k: 692 / 667, causal 676 / 669); below 4k keys
    # the persistent short-key tile runs. Before: 0.960 for 128 x 128 (ping-pong 0.939; no overlap 0.852;
    # 64-key x 3 stages 0.795)
    128: Sm90WsTile(192, 80, pingpong=False),
    # 2 warpgroups x 80-key tiles (FlashAttention-3's), 226 KB: 1.007 over 512-16k x causal (64-key tiles 0.940 in
    # the same run; at 64 keys before: 0.978, ping-pong 0.960, no overlap 0.894, over 1k-16k)
    256: Sm90WsTile(128, 80, pingpong=False),
}

#: Dropout's own tile beyond the short keys, per head-dim bucket. Head dim 64: the 192-row default (3 consumer
#: warpgroups at 160 registers a thread) parks 128-144 bytes with dropout's keep bits, 128 x 128 (2 at 240)
#: none. tools/tune_fwd.py --ws --variant dropout (session 26, bf16, vs SDPA FlashAttention-2 with the same
#: dropout, each head dim in one run): hd64 over 1k/4k/16k x causal: 192 x 128 median 0.976 (0.71-1.10),
#: 128 x 128 1.110 (0.95-1.18; +10-17% at 4k-16k keys), 192 x 64 1.089 (3 stages 1.096), the persistent
#: 128 x 128 1.080. hd128 (whose default becomes 192 x 64 with dropout: fit_key_tile; no spills), 8k/16k keys:
#: 128 x 128 against 192 x 64 1.05 / 1.06 causal, 0.99 / 1.00 not. Up to SHORT_KEYS the short-key tile runs
#: as without dropout. (Softcap parks 44-56 bytes on hd64's default but measured best there: 2.03 against
#: 1.90-2.02 vs FlexAttention.)
FWD_SM90_WS_DROPOUT_TILES: dict[int, Sm90WsTile] = {
    64: Sm90WsTile(128, 128, pingpong=False),
    128: Sm90WsTile(128, 128, pingpong=False),
}


def ws_default_tile(bucket: int, mods: int = 0, *, paged: bool = False) -> Sm90WsTile:
    """The warp-specialized forward's default tile for ``bucket`` (beyond the short keys), fitted to its
    key-tile rules (fit_key_tile): FWD_SM90_WS_TILES, with dropout in ``mods`` its FWD_SM90_WS_DROPOUT_TILES
    row where it has one."""
    if mods & MOD_DROPOUT and bucket in FWD_SM90_WS_DROPOUT_TILES:
        return fit_key_tile(FWD_SM90_WS_DROPOUT_TILES[bucket], paged=paged, mods=mods)
    return fit_key_tile(FWD_SM90_WS_TILES[bucket], paged=paged, mods=mods)


#: Paged K/V (a packed batch with a block_table): a key tile must not straddle two pages, and page sizes
#: are multiples of PAGE_KEYS (cuflash/varlen.py checks it). Dropout draws its random bits in blocks
#: of 16 rows x DROPOUT_KEYS keys (masks.cuh), so its key tiles are multiples of DROPOUT_KEYS.
PAGE_KEYS = 128
DROPOUT_KEYS = 32

#: Key-tile widths the warp-specialized forward builds: the N of S = Q K^T's wgmma, one of the shapes
#: tools/gen_wgmma.py generates (N_VALUES; tests/test_wgmma_header.py checks that they agree).
WS_KEY_TILES = (32, 64, 80, 96, 112, 128, 144, 160, 176, 192, 256)


def fit_key_tile(tile: Sm90WsTile, *, paged: bool = False, mods: int = 0) -> Sm90WsTile:
    """``tile``, or where its key tiles break a rule above (paged: block_n divides PAGE_KEYS; dropout
    in ``mods``: a multiple of DROPOUT_KEYS) the same tile with the largest power of two below its
    block_n, within DROPOUT_KEYS .. PAGE_KEYS (head dim 256's 128 x 80 -> 128 x 64, 128's 192 x 80 -> 192 x 64)."""
    if (not paged or PAGE_KEYS % tile.block_n == 0) and (not mods & MOD_DROPOUT or tile.block_n % DROPOUT_KEYS == 0):
        return tile
    return dataclasses.replace(tile, block_n=min(PAGE_KEYS, max(DROPOUT_KEYS, 1 << (tile.block_n.bit_length() - 1))))

#: Short keys: a CTA's fixed costs (its Q load, pipeline fill, epilogue) weigh more than its few K/V
#: tiles, and the persistent schedule overlaps them with the next tile's loads. Measured on the H200
#: (tools/tune_fwd.py --ws --match, bf16, persistent / default TFLOP/s): hd128 512 tokens 1.07
#: non-causal, 1.12 causal, 1024 causal 1.06, but 1024 non-causal 0.97, 2048 0.91-1.00, 16k 0.90-0.97;
#: hd64 (128 rows, persistent, against the 192-row default) 512 tokens 1.13 / 1.33, 1024 causal 1.23.
#: Since then the walk goes in L2-sized groups (persistent_group), and with the non-causal groups small
#: (PERSISTENT_L2_SHARE) the persistent tile also wins at hd128 up to 4096 keys (tools/ab_sources.py,
#: session 11: non-causal 1024 1.09, 2048 1.00, 4096 1.02; causal 2048 1.05, 4096 1.03) and at hd64
#: non-causal 1024 (1.04; its 128 rows lose to the default's 192 at 2048-4096: 0.88-0.90). SHORT_KEYS.
#: Two Q slots, chained tiles and a persistent hd256 tile were measured in session 12 and not kept
#: (docs/history/hopper.md). O leaves the persistent tiles by 16-byte stores: with TMA stores (which
#: share the TMA unit with the next tile's loads, in flight during the epilogue) they ran 0.94-1.03x
#: (median 0.98) at 512-2048 keys (tools/ab_sources.py, session 14), the per-tile launches 0.99-1.04x
#: (median 1.01).
#: hd256 takes a per-tile launch of 64-key tiles there: 512 keys are 8 of them, against 6.4 of the default's 80
#: (its last tile 40% full): 1.07x the default non-causal, 1.02x causal (tools/tune_fwd.py, session 18), 1.04x
#: and 1.07x in the A/B of the planner change (tools/ab_sources.py, session 19); at 1024 keys (12.8 tiles of
#: 80) 0.98-1.00x (session 18).
#: The causal walk (Sm90WsTile.paired; session 38, H100, bf16, tools/tune_fwd.py, TFLOP/s strided -> paired, two
#: runs): hd128 512 keys 211/213 -> 225/222, 1024 320/320 -> 343/346, 2048 381/380 -> 457/452, 4096 476/475 ->
#: 527/529 (the strided walk's CTAs carry 0.76-0.91 of an even share there, by the L2 group size on 50 MiB);
#: hd64 512 189/198 -> 173/182, 1024 270/260 -> 249/250, 2048 324/320 -> 321/321 (also with the light tile first on
#: every other CTA). The trace of hd64 causal 512 (session 39) put the loss between items: 0.40 us strided, 0.71
#: paired, the walk's integer divisions (more of them on the paired walk). With the divisions on FastDiv
#: multipliers (FwdParams.walk_*): 0.21 / 0.28 us, and hd64 causal strided -> paired 191 -> 197 at 512 keys, 272 ->
#: 275 at 1024, 321 -> 341 at 2048 (one run, H100): both head dims take the paired walk.
FWD_SM90_WS_SHORT_TILES: dict[int, Sm90WsTile] = {
    64: Sm90WsTile(128, 128, pingpong=False, persistent=True, tma_store=False),
    128: Sm90WsTile(128, 128, pingpong=False, persistent=True, tma_store=False),
    256: Sm90WsTile(128, 64, pingpong=False),
}


#: Keys per sequence up to which FWD_SM90_WS_SHORT_TILES run, per head-dim bucket: (non-causal, causal).
#: hd128 non-causal from 4096 keys: the 192-row default tile (621 against 602-616 TFLOP/s at 4096, session 17,
#: the fix's first build). hd64 causal to 2048 keys: the persistent 128 x 128 against the 192 x 128 default
#: at 2048 causal keys 353 / 340 / 341 against 344 / 333 / 340 TFLOP/s (three rounds, session 31), at 4096
#: 375 / 382 against 401 / 407.
SHORT_KEYS: dict[int, tuple[int, int]] = {64: (1024, 2048), 128: (2048, 4096), 256: (512, 512)}


#: Keys per sequence from which the default tile runs in clusters of 2 CTAs that share each K/V tile by
#: TMA multicast (Sm90WsTile.cluster), per head-dim bucket. A/B on the H200 (tools/ab_sources.py, bf16,
#: clusters everywhere against none, one run, TFLOP/s): at 8192 keys hd128 587 -> 594, causal 541 -> 562,
#: hd256 663 -> 692, causal 607 -> 627-642; hd64 at 8192 0.95-0.97x; and 0.83-0.97x at 512-2048 keys
#: causal (a pair moves in lockstep, and a causal pair's lower CTA idles through the upper one's
#: diagonal block), hd64 0.87-0.98x non-causal there, hd128 0.97-1.03x. Halving the K/V bytes outright
#: (an experiment with wrong results) gave hd128 8192 +19%: what limits the steady state is what each SM
#: takes in, not what the L2 serves, and multicast only halves the L2's side.
#: Session 17, once each warpgroup's softmax overlapped its P V product: clusters no longer pay (tools/
#: tune_fwd.py on the fix's first build, same run, clusters / none: hd128 8192 keys 0.98, causal 0.96, 16k
#: 1.00 / 0.99; hd256 8192 0.99 / 1.00, 16k 1.01 / 1.01), so no head dim takes them; the tiles stay
#: buildable (test_compile_variants) and tested on the GPU. Not re-measured on the landed build, whose A/B
#: against clusters at hd256 8192 (the old kernel) was 0.96-0.99x.
CLUSTER_KEYS: dict[int, int] = {}


#: Share of the GPU's L2 cache that the K/V of one group of a persistent walk may fill (persistent_group),
#: by the causal flag. Non-causal tiles all cost the same: small groups keep the K/V that the running
#: CTAs read few (hd128 1024 keys: 1.09x the 0.5 share, A/B of session 11). Causal: a round of the walk
#: should be one query tile of many pairs, so that the CTAs running together carry equal loads (0.08
#: there cost hd128 causal 512-1024 keys 5-11%).
PERSISTENT_L2_SHARE: dict[bool, float] = {False: 0.08, True: 0.5}


def persistent_group(pairs: int, seqlen_k: int, head_dim: int, head_ratio: int, l2_bytes: int | None,
                     causal: bool = False) -> int:  # fmt: skip
    """(head, batch) pairs per group of the persistent forward's walk (FwdParams.sched_group).

    A persistent CTA walks work items in groups of ``pairs`` (head, batch) pairs: inside a group the
    query-tile index is outermost (causal: the heaviest tiles first), so the CTAs that run together
    read the K/V of the group's heads only. A group is as many pairs as keep that K/V (2 x seqlen_k x d
    x 2 bytes per kv head, shared by ``head_ratio`` query heads) within PERSISTENT_L2_SHARE[causal] of
    the L2: with one group of every pair, long sequences read K/V from HBM once per query tile (the
    persistent grid then ran 0.79-0.97x the per-tile launch at 2k-16k tokens). ``l2_bytes`` None: one group."""
    if pairs < 1 or seqlen_k < 0 or head_ratio < 1:
        raise ValueError(f"persistent_group needs pairs >= 1, seqlen_k >= 0 and head_ratio >= 1 "
                         f"(got {pairs}, {seqlen_k}, {head_ratio})")  # fmt: skip
    if l2_bytes is None:
        return pairs
    per_pair = 4 * max(seqlen_k, 1) * head_dim / head_ratio
    return max(1, min(pairs, int(PERSISTENT_L2_SHARE[bool(causal)] * l2_bytes // per_pair)))


def short_keys_hint(seqlen_k: int) -> int:
    """``seqlen_k`` clamped to just past the longest short keys (SHORT_KEYS): for packed batches, which
    never run in clusters (CLUSTER_KEYS), sm90_ws_tile gives every longer one the same tile, so callers
    that cache their plans by it (varlen.run) share one entry for them."""
    return min(int(seqlen_k), max(max(v) for v in SHORT_KEYS.values()) + 1)


def sm90_ws_tile(bucket: int, seqlen_k: int, causal: bool, default_only: bool = False, mods: int = 0) -> Sm90WsTile:
    """The warp-specialized forward's tile for a call: FWD_SM90_WS_SHORT_TILES where the keys are
    short (at most SHORT_KEYS[bucket][causal]; packed batches: the longest sequence's), else
    ws_default_tile (FWD_SM90_WS_TILES; dropout's own where ``mods`` has it), in clusters of 2 from
    CLUSTER_KEYS[bucket] keys (plan_forward drops them for few query tiles: cluster_pays; packed
    batches never take them: fwd_sm90_ws_spec). ``default_only``:
    always the default (packed batches whose longest sequence is not known; plans without the GPU's
    SM count)."""
    if not default_only and bucket in FWD_SM90_WS_SHORT_TILES and seqlen_k <= SHORT_KEYS[bucket][bool(causal)]:
        return FWD_SM90_WS_SHORT_TILES[bucket]
    if not default_only and seqlen_k >= CLUSTER_KEYS.get(bucket, 1 << 62):
        return dataclasses.replace(ws_default_tile(bucket, mods), cluster=2)
    return ws_default_tile(bucket, mods)


def fwd_sm90_ws_smem_bytes(head_dim_bucket: int, tile: Sm90WsTile) -> int:
    """Dynamic shared memory of the warp-specialized forward: must match Sm90WsFwdConfig::kSmemBytes
    (alignment slack, Q (look-ahead: two slots), the K/V ring, persistent: an O staging tile, 2 + 4 * stages
    mbarriers of 8 bytes (look-ahead: 2 more) rounded to 16)."""
    q_slots = 2 if getattr(tile, "look_ahead", False) else 1
    barriers = 2 + 4 * tile.stages + 2 * (q_slots - 1)
    o_rows = tile.block_m if getattr(tile, "persistent", False) else 0  # persistent: O staged in a tile of its own
    return (1024 + 2 * (q_slots * tile.block_m + o_rows + 2 * tile.stages * tile.block_n) * head_dim_bucket
            + 8 * ((barriers + 1) // 2 * 2))  # fmt: skip


def fwd_tile(bucket: int, arch: str) -> Tile:
    """The forward tile for a head-dim bucket on ``arch``: the FWD_TILES row (tuned on the H200), single
    buffered where that keeps the row's CTAs per SM (min_blocks) on a GPU with less shared memory per SM
    (the A100's 164 KB hold two 68 KiB hd128 CTAs, not two of 102 KiB: FlashAttention-2's A100 tile; on the
    H200, where both fit twice, single buffering measured within 1% of double: FWD_TILES' note), or,
    where the row needs more shared memory than one CTA may have, the first smaller shape that fits:
    single-buffered, then 32-key tiles, then 64 query rows of 4 warps (untuned on those GPUs)."""
    t = FWD_TILES[bucket]
    single = dataclasses.replace(t, stages=1)
    if ctas_per_sm_by_smem(fwd_smem_bytes(bucket, t), arch) < t.min_blocks <= ctas_per_sm_by_smem(
            fwd_smem_bytes(bucket, single), arch):  # fmt: skip
        return single
    candidates = (
        t,
        single,
        dataclasses.replace(t, stages=1, block_n=32),
        Tile(64, 32, 4, False, 1, stages=1),
    )
    limit = max_smem_bytes(arch)
    for c in candidates:
        if fwd_smem_bytes(bucket, c) <= limit:
            return c
    raise ValueError(f"no forward tile for head dim {bucket} fits the {limit // 1024} KB of shared memory of {arch}")


@dataclass(frozen=True)
class KernelSpec(TiledSpec):
    """One compiled forward variant (mma.sync): every template argument, and the target arch."""

    family: str  # "flash_fwd"
    head_dim: int  # bucket
    dtype: str  # "fp16" | "bf16"
    causal: bool
    aligned: bool  # 16-byte vector loads (else element-wise loads for odd head dims / strides)
    tile: Tile
    arch: str  # "sm_80", "sm_90a", ...
    mods: int = 0  # attention variants (common.MOD_* bits)

    @property
    def name(self) -> str:
        """Human-readable name spelling every template argument; also the kernel's symbol."""
        return self._variant_name(f"_{'qreg' if self.tile.q_in_regs else 'qsmem'}")

    @property
    def smem_bytes(self) -> int:
        return fwd_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        """C++ template argument list of cuflash::FwdConfig for this variant."""
        t, b = self.tile, cpp_bool
        return (
            f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.warps}, {b(self.dtype == 'bf16')}, "
            f"{b(self.causal)}, {b(self.aligned)}, {b(t.q_in_regs)}, {t.stages}{mods_arg(self.mods)}"
        )


@dataclass(frozen=True)
class Sm90KernelSpec(HopperSpec):
    """One Hopper forward variant (wgmma, sm_90a, 16-byte loads only)."""

    tile: Sm90Tile
    family: str = "flash_fwd_sm90"

    @property
    def smem_bytes(self) -> int:
        return fwd_sm90_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        """C++ template argument list of cuflash::Sm90FwdConfig for this variant."""
        t, b = self.tile, cpp_bool
        return (f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.stages}, {b(self.dtype == 'bf16')}, {b(self.causal)}"
                f"{mods_arg(self.mods)}")


@dataclass(frozen=True)
class Sm90WsKernelSpec(HopperSpec):
    """One warp-specialized Hopper forward variant (TMA, wgmma, sm_90a)."""

    tile: Sm90WsTile
    family: str = "flash_fwd_sm90_ws"

    @property
    def name(self) -> str:
        t = self.tile
        return self._variant_name(f"{'_ov' if t.overlap else ''}{'_pp' if t.sched & 2 else ''}"
                                  f"{'_persistent' if t.persistent else ''}{'_tmao' if t.tma_store else ''}"
                                  f"{f'_c{t.cluster}' if t.cluster > 1 else ''}{'_la' if t.look_ahead else ''}"
                                  f"{'_strided' if t.persistent and not t.paired else ''}")

    @property
    def cluster(self) -> int:
        """CTAs per thread-block cluster (the entry point's __cluster_dims__; grids are multiples of it)."""
        return self.tile.cluster

    @property
    def smem_bytes(self) -> int:
        return fwd_sm90_ws_smem_bytes(self.head_dim, self.tile)

    def template_args(self) -> str:
        """C++ template argument list of cuflash::Sm90WsFwdConfig for this variant."""
        t, b = self.tile, cpp_bool
        return (f"{self.head_dim}, {t.block_m}, {t.block_n}, {t.stages}, {b(self.dtype == 'bf16')}, {b(self.causal)}, "
                f"{self.mods}, {t.sched}")


def fwd_sm90_ws_spec(head_dim: int, dtype: str, causal: bool, tile: Sm90WsTile | None = None,
                     mods: int = 0) -> Sm90WsKernelSpec:  # fmt: skip
    """The warp-specialized Hopper forward for ``head_dim`` (its bucket must have a FWD_SM90_WS_TILES
    row, or give ``tile``)."""
    bucket = head_dim_bucket(head_dim)
    check_dtype(dtype)
    if head_dim % 8 != 0:
        raise ValueError("the TMA kernel needs head_dim % 8 == 0 (16-byte rows)")
    if tile is None:
        if bucket not in FWD_SM90_WS_TILES:
            raise ValueError(f"no warp-specialized forward tile for head-dim bucket {bucket} (have {sorted(FWD_SM90_WS_TILES)})")
        tile = ws_default_tile(bucket, mods)
    if bucket % 64 or tile.block_m not in (128, 192) or tile.block_n not in WS_KEY_TILES or not 2 <= tile.stages <= 4:
        raise ValueError(f"warp-specialized tile {tile} for bucket {bucket}: needs block_m 128 or 192, block_n one "
                         f"of {WS_KEY_TILES} and 2 to 4 stages")  # fmt: skip
    if mods & MOD_DROPOUT and tile.block_n % DROPOUT_KEYS:
        raise ValueError(f"warp-specialized tile {tile}: dropout needs key tiles of a multiple of {DROPOUT_KEYS} "
                         f"(fit_key_tile gives one)")  # fmt: skip
    if tile.min_blocks != 1:  # the register hand-over (setmaxnreg) splits the 1-CTA/SM register file exactly
        raise ValueError(f"warp-specialized tile {tile}: min_blocks must be 1")
    if tile.block_m == 192 and bucket // 2 + 3 * tile.block_n // 4 > 128:  # 160 registers per consumer thread
        raise ValueError(f"warp-specialized tile {tile}: O + S + P registers do not fit 3 consumer warpgroups "
                         f"at head dim {bucket} (take block_m 128 or a smaller block_n)")  # fmt: skip
    if fwd_sm90_ws_smem_bytes(bucket, tile) > max_smem_bytes("sm_90a"):
        raise ValueError(f"warp-specialized tile {tile} needs {fwd_sm90_ws_smem_bytes(bucket, tile)} bytes of shared memory")
    if tile.cluster not in (1, 2) or tile.block_n // tile.cluster % 8:
        raise ValueError(f"warp-specialized tile {tile}: cluster must be 1 or 2, and each CTA's share of a key tile "
                         f"(block_n / cluster) a multiple of 8 rows")  # fmt: skip
    if mods & MOD_VARLEN and tile.tma_store:  # a box of a sequence's last rows would write into the next one's
        tile = dataclasses.replace(tile, tma_store=False)  # (one spec, one name, and no output map to encode)
    if mods & MOD_VARLEN and tile.cluster > 1:  # the query tiles of a cluster belong to one (head, batch) pair
        tile = dataclasses.replace(tile, cluster=1)
    if mods & MOD_VARLEN and tile.look_ahead:  # (the varlen scheduler's items are not known a walk ahead)
        tile = dataclasses.replace(tile, look_ahead=False)
    if tile.look_ahead and (not tile.persistent or not tile.overlap or tile.sched & 2 or tile.cluster > 1
                            or tile.block_m != 128 or tile.block_n > tile.block_m):  # fmt: skip
        # (3 consumer warpgroups, 160 registers a thread, park 72 bytes with the S in flight through the epilogue)
        raise ValueError(f"warp-specialized tile {tile}: look_ahead needs a persistent, overlapped 128-row tile "
                         f"without ping-pong or clusters, and block_n <= block_m")  # fmt: skip
    return Sm90WsKernelSpec(bucket, dtype, bool(causal), tile, mods=check_mods(mods))


def uses_sm90_ws_forward(head_dim: int, aligned: bool, arch: str) -> bool:
    """True when the forward runs the warp-specialized TMA kernel: sm_90a, 16-byte rows, a bucket of
    FWD_SM90_WS_TILES."""
    return arch == "sm_90a" and aligned and head_dim % 8 == 0 and head_dim_bucket(head_dim) in FWD_SM90_WS_TILES


def fwd_sm90_spec(head_dim: int, dtype: str, causal: bool, tile: Sm90Tile | None = None, mods: int = 0) -> Sm90KernelSpec:
    """The Hopper forward variant for ``head_dim`` (its bucket must have a FWD_SM90_TILES row, or give ``tile``)."""
    bucket = head_dim_bucket(head_dim)
    check_dtype(dtype)
    if head_dim % 8 != 0:
        raise ValueError("the Hopper kernel loads 16-byte chunks: it needs head_dim % 8 == 0")
    if tile is None:
        if bucket not in FWD_SM90_TILES:
            raise ValueError(f"no Hopper forward tile for head-dim bucket {bucket} (have {sorted(FWD_SM90_TILES)})")
        tile = FWD_SM90_TILES[bucket]
    if bucket % 64 or tile.block_m % 64 or tile.block_n % 64 or tile.stages != 2:
        raise ValueError(f"Hopper tile {tile} for bucket {bucket}: needs multiples of 64 and 2 stages")
    threads, chunks = tile.warps * 32, bucket // 8
    if threads % chunks or (threads // chunks) % 8:
        raise ValueError(f"Hopper tile {tile}: {threads} threads do not split {chunks}-chunk rows evenly")
    if fwd_sm90_smem_bytes(bucket, tile) > max_smem_bytes("sm_90a"):
        raise ValueError(f"Hopper tile {tile} needs {fwd_sm90_smem_bytes(bucket, tile)} bytes of shared memory")
    return Sm90KernelSpec(bucket, dtype, bool(causal), tile, mods=check_mods(mods))


def uses_sm90_forward(head_dim: int, aligned: bool, arch: str) -> bool:
    """True when the forward runs the Hopper wgmma kernel: sm_90a, 16-byte loads, a tuned bucket."""
    return arch == "sm_90a" and aligned and head_dim % 8 == 0 and head_dim_bucket(head_dim) in FWD_SM90_TILES


def fwd_spec(head_dim: int, dtype: str, causal: bool, aligned: bool, arch: str, tile: Tile | None = None,
             mods: int = 0) -> KernelSpec:
    bucket = head_dim_bucket(head_dim)
    check_dtype(dtype)
    if aligned and head_dim % 8 != 0:
        raise ValueError("the 16-byte load path needs head_dim % 8 == 0")
    tile = tile or fwd_tile(bucket, arch)
    if fwd_smem_bytes(bucket, tile) > max_smem_bytes(arch):
        raise ValueError(
            f"tile {tile} needs {fwd_smem_bytes(bucket, tile)} bytes of shared memory; {arch} allows "
            f"{max_smem_bytes(arch)}"
        )
    return KernelSpec("flash_fwd", bucket, dtype, bool(causal), bool(aligned), tile, arch, check_mods(mods))


def plan_forward(
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
    tile: Tile | Sm90Tile | Sm90WsTile | None = None,
    mods: int = 0,
    sm_count: int | None = None,
    max_seqlen_k: int | None = None,
    l2_bytes: int | None = None,
    paged: bool = False,
) -> Launch:
    """Kernel variant, grid, block and shared memory for one forward call (all sizes >= 1).

    On sm_90a with 16-byte aligned inputs and a bucket of FWD_SM90_WS_TILES the warp-specialized TMA
    kernel runs, else the mma.sync kernel; a given ``tile`` picks the kernel by its type (an Sm90Tile:
    the cp.async wgmma kernel, which the callers also fall back to where no tensor map can describe
    an input). ``mods``: the
    attention variants (common.MOD_* bits) compiled into the kernel. With MOD_VARLEN, batch is the
    number of packed sequences and seqlen_q / seqlen_k the packed totals: the grid is the scheduler's
    seqlen_q // block_m + batch slots per head (cuda_src/varlen.cuh). A persistent Sm90WsTile launches
    min(tiles, ``sm_count``) CTAs that walk those tiles; Launch.m_blocks is the query-tile (or slot)
    count of FwdParams.num_m_blocks either way. ``max_seqlen_k`` (packed batches): the longest
    sequence's keys, which choose the short-key tile as seqlen_k does for a plain batch (None: the
    default tile). ``l2_bytes``: the GPU's L2 cache, which sizes a persistent launch's groups
    (persistent_group; None: one group). ``paged``: K/V in pages of a multiple of PAGE_KEYS keys
    (the planned tile's key tiles then divide PAGE_KEYS: fit_key_tile)."""
    if min(batch, seqlen_q, nheads, nheads_kv) < 1 or seqlen_k < (0 if mods & MOD_VARLEN else 1):
        raise ValueError("plan_forward needs non-empty dimensions; empty inputs never launch")
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if isinstance(tile, Sm90WsTile) or (tile is None and uses_sm90_ws_forward(head_dim, aligned, arch)):
        if arch != "sm_90a" or not aligned:
            raise ValueError("the warp-specialized forward kernel needs arch sm_90a and 16-byte aligned inputs")
        if tile is None:  # (the short-key tiles need sm_count: without it, the default tile)
            varlen = bool(mods & MOD_VARLEN)
            keys = (max_seqlen_k or 0) if varlen else seqlen_k
            default_only = (varlen and max_seqlen_k is None) or not sm_count
            tile = sm90_ws_tile(head_dim_bucket(head_dim), keys, causal, default_only, mods)
            tile = fit_key_tile(tile, paged=paged, mods=mods)
            if tile.cluster > 1 and not cluster_pays(-(-seqlen_q // tile.block_m), tile.cluster):
                tile = dataclasses.replace(tile, cluster=1)
        spec = fwd_sm90_ws_spec(head_dim, dtype, causal, tile, mods)
    elif isinstance(tile, Sm90Tile) or (tile is None and uses_sm90_forward(head_dim, aligned, arch)):
        if arch != "sm_90a" or not aligned:
            raise ValueError("the Hopper forward kernel needs arch sm_90a and 16-byte aligned inputs")
        spec = fwd_sm90_spec(head_dim, dtype, causal, tile, mods)
    else:
        spec = fwd_spec(head_dim, dtype, causal, aligned, arch, tile, mods)
    if mods & MOD_VARLEN:
        grid = (varlen_tiles(seqlen_q, batch, spec.tile.block_m), nheads, 1)
    else:
        grid = (-(-seqlen_q // spec.tile.block_m), nheads, batch)
    m_blocks, cluster, pairs = grid[0], getattr(spec.tile, "cluster", 1), grid[1] * grid[2]
    if getattr(spec.tile, "persistent", False):  # one CTA per SM (at most one per tile) walks grid's tiles
        if sm_count is None or sm_count < cluster:
            raise ValueError("a persistent tile needs sm_count (the GPU's multiprocessors)")
        group = persistent_group(pairs, seqlen_k, head_dim, nheads // nheads_kv, l2_bytes, causal)
        items = -(-m_blocks // cluster) * pairs  # (clusters: pairs of query tiles)
        ctas = min(items, sm_count // cluster) * cluster
        return Launch(spec, (ctas, 1, 1), (spec.threads, 1, 1), spec.smem_bytes, m_blocks=m_blocks, sched_group=group,
                      walk=fwd_walk(m_blocks, cluster, ctas // cluster, group, pairs, nheads, nheads // nheads_kv))  # fmt: skip
    grid = (-(-m_blocks // cluster) * cluster,) + grid[1:]  # (clusters: an odd count's last CTA only helps load)
    return Launch(spec, grid, (spec.threads, 1, 1), spec.smem_bytes, m_blocks=m_blocks,
                  walk=fwd_walk(m_blocks, cluster, 1, 1, pairs, nheads, nheads // nheads_kv))  # fmt: skip


def fwd_walk(m_blocks: int, cluster: int, step: int, group: int, pairs: int, nheads: int, head_ratio: int
             ) -> tuple[int, ...]:  # fmt: skip
    """The divisors of FwdParams' FastDiv fields, in cuflash/params.py WALK_FIELDS order, for a launch of
    ``m_blocks`` query tiles per (head, batch) pair (varlen: scheduler slots) in clusters of ``cluster``, over
    ``pairs`` (head, batch) pairs (varlen: heads) in groups of ``group`` (FwdParams.sched_group), a persistent
    CTA taking every ``step``-th item (gridDim.x / cluster; 1 for the per-tile launches, whose kernels read
    only the last): the persistent walk's stride, its items and the paired walk's units per group, the
    group's and the last group's pairs, nheads and nheads / nheads_kv (flash_fwd_sm90_ws.cuh locate)."""
    if min(m_blocks, cluster, step, group, pairs, nheads, head_ratio) < 1:
        raise ValueError(f"fwd_walk needs every count >= 1, got {(m_blocks, cluster, step, group, pairs, nheads, head_ratio)}")
    if -(-m_blocks // cluster) * pairs >= 1 << 31:  # (the kernel's item indices are 32-bit, FastDiv's numerators < 2^31)
        raise ValueError(f"{m_blocks} query tiles x {pairs} (head, batch) pairs: over 2^31 work items")
    tail = pairs - (pairs - 1) // group * group
    return (step, group * -(-m_blocks // cluster), group * max(m_blocks // 2, 1), group, tail, nheads, head_ratio)


def cluster_pays(m_blocks: int, cluster: int) -> bool:
    """Whether clusters of ``cluster`` CTAs suit ``m_blocks`` query tiles per (head, batch) pair: a count
    that is not a multiple leaves CTAs that only help load, and those may be at most 1/8 of the CTAs
    (with clusters of 2: 1, 3 or 5 query tiles run without clusters)."""
    spare = -m_blocks % cluster
    return m_blocks >= cluster and 8 * spare <= m_blocks + spare


def varlen_tiles(total: int, batch: int, block: int) -> int:
    """Slots of the varlen tile scheduler (cuda_src/varlen.cuh) for ``batch`` packed sequences of
    ``total`` rows in tiles of ``block`` rows: every sequence's tiles plus at most one spare each."""
    return total // block + batch


def all_fwd_specs(arch: str, head_dims=HEAD_DIM_BUCKETS, dtypes=DTYPES, causals=(False, True), aligned=(True, False),
                  mods=(0,)):  # fmt: skip
    """Every forward variant the library can launch for ``arch`` (what `cuflash precompile --all` builds):
    the mma.sync kernel for every combination, and on sm_90a the Hopper kernel for the aligned ones
    of its buckets. ``mods``: the variant combinations (common.MOD_* bits) to include."""
    specs = []
    for d in head_dims:
        bucket = head_dim_bucket(d)
        for dt in dtypes:
            for c in causals:
                for al in aligned:
                    for m in mods:
                        specs.append(KernelSpec("flash_fwd", bucket, dt, c, al, fwd_tile(bucket, arch), arch, m))
                        if al and uses_sm90_forward(bucket, True, arch):
                            specs.append(fwd_sm90_spec(bucket, dt, c, mods=m))
                        if al and uses_sm90_ws_forward(bucket, True, arch):
                            default = ws_default_tile(bucket, m)
                            specs.append(fwd_sm90_ws_spec(bucket, dt, c, default, m))
                            if bucket in FWD_SM90_WS_SHORT_TILES:
                                specs.append(fwd_sm90_ws_spec(bucket, dt, c, FWD_SM90_WS_SHORT_TILES[bucket], m))
                            if bucket in CLUSTER_KEYS:  # (packed batches: the same spec, without clusters)
                                specs.append(fwd_sm90_ws_spec(bucket, dt, c, dataclasses.replace(default, cluster=2), m))
                            if m & MOD_VARLEN:  # (packed batches may be paged)
                                paged = ws_default_tile(bucket, m, paged=True)
                                specs.append(fwd_sm90_ws_spec(bucket, dt, c, paged, m))
    return list(dict.fromkeys(specs))  # unique, order kept


def with_tile(spec: KernelSpec, tile: Tile) -> KernelSpec:
    """The same variant with another tile (for tuning sweeps)."""
    return dataclasses.replace(spec, tile=tile)
