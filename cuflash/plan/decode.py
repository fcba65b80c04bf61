"""Decode planning: how one attention_with_kvcache call is cut into key splits and grids, and which
kernels run (cuda_src/flash_decode.cuh and its combine / append kernels). Every tunable rule is a
field of DecodePolicy, passed explicitly; docs/history/decode-policy.md holds the measurements behind
each value. Pure Python: testable on a CPU machine."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from .common import ALL_MODS, DTYPES, HEAD_DIM_BUCKETS, MAX_GRID_X, MOD_DROPOUT, MOD_WINDOW, Launch, head_dim_bucket, supports_pdl
from .decode_kernels import (
    DECODE_COMBINE_LEAN_BATCH, DECODE_M_SLABS, DECODE_THREADS, MAX_DECODE_SPLITS, DecodeAppendSpec, DecodeCombineSpec,
    RotarySpec,
    DecodeSpec, DecodeTile, decode_launch_smem, decode_m_slabs, decode_m_slabs_options, decode_spec, decode_tile,
)  # fmt: skip


@dataclass(frozen=True)
class DecodePolicy:
    """The rules of the decode plan that are tuned rather than derived: one frozen object, passed to
    plan_decode (and by attention_with_kvcache(policy=...)). The defaults are what the H200 measured
    best; tools and tests build another policy (dataclasses.replace) instead of patching anything.
    A grid of "groups" below means the (sequence, kv head) pairs, each one CTA per split."""

    # --- Split count (decode_num_splits) ---
    #: Fewest keys per split: below it a CTA's pipeline fill and its partial row outweigh its tiles.
    min_keys_per_split: int = 256
    #: Most keys per split: one very long CTA ends later than its neighbours (2% slower at 32k keys).
    max_keys_per_split: int = 16384
    #: Fixed cost of one CTA (pipeline fill, epilogue, the merge's share) in K/V tiles of streaming.
    cta_overhead_tiles: int = 1

    # --- CTAs per SM of the split kernel ---
    #: Split CTAs that stream at least long_cta_keys keys run long_ctas_per_sm per SM (shared memory
    #: padded), shorter ones as many as the tile holds: long CTAs stream faster about 2 per SM in
    #: whole waves, short ones hide their start and end better 3 per SM.
    long_cta_keys: int = 3072
    long_ctas_per_sm: int = 2
    #: Split CTAs resident per SM forced for every call: 0 = the rules above; 1..the tile's min_blocks.
    ctas_per_sm: int = 0

    # --- Merge of the splits ---
    #: Partial rows per group above which the combine kernel merges (else the group's last split CTA
    #: merges inside the split kernel, saving a launch; alone on a busy SM it is slow for many rows).
    in_kernel_merge_max: int = 64
    #: The wide combine kernel's CTAs per SM (~185 registers a thread): above one wave of them the
    #: lean kernel runs (decode_combine_lean).
    combine_wide_ctas_per_sm: int = 2
    #: "auto" (decode_combine_lean decides), "lean" or "wide": which combine kernel variant runs.
    combine: str = "auto"

    # --- Filled grid (_filled_grid): the splits a little longer, a short tail split started last ---
    #: Fewest tiles per long split for a one-split plan to be filled (the tail adds a merge).
    fill_min_unsplit_tiles: int = 96
    #: ... and where fewer than fill_unsplit_min_free of the last wave's slots are empty, at least
    #: fill_min_unsplit_tiles_full tiles: the slots recovered are few, the merge costs the same.
    fill_unsplit_min_free: float = 0.1
    fill_min_unsplit_tiles_full: int = 192

    # --- Tail-split grid (_tail_split): whole groups, the last wave's groups split and started last ---
    tail_split_buckets: tuple[int, ...] = (128,)  # buckets with the kTailGrid variants (measured)
    tail_split_max_fill: float = 0.7  # the last wave at most this full (a fuller one runs near full rate)
    tail_split_min_waves: int = 2  # whole waves before it
    tail_split_min_tiles: int = 32  # tiles per group
    tail_split_min_gain: float = 0.01  # modeled time saved (a share of the one-split time; <= 0: any)

    # --- Deep grid (_deep_grid): whole groups at the tile's CTAs per SM, with a tail split ---
    deep_min_waves: int = 4  # waves of whole groups at min_blocks per SM
    deep_max_keys: int = 4096  # longest group (longer ones were slower whole)

    # --- Unsplit wave (_unsplit_wave): about one whole group per SM, one CTA per SM ---
    one_wave_buckets: tuple[int, ...] = (128,)  # buckets measured (the stepped loads: one slab)
    one_wave_min_fill: float = 0.95  # the groups give a CTA to at least this share of the SMs

    def __post_init__(self):
        def bad(name: str, want: str):
            raise ValueError(f"DecodePolicy.{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, numbers.Integral) and not isinstance(x, bool)

        if self.combine not in ("auto", "lean", "wide"):
            bad("combine", "'auto', 'lean' or 'wide'")
        for name in ("min_keys_per_split", "max_keys_per_split", "cta_overhead_tiles", "long_cta_keys",
                     "long_ctas_per_sm", "combine_wide_ctas_per_sm", "fill_min_unsplit_tiles", "fill_min_unsplit_tiles_full",
                     "tail_split_min_waves", "tail_split_min_tiles", "deep_min_waves", "deep_max_keys"):
            if not is_int(getattr(self, name)) or getattr(self, name) < (0 if name == "cta_overhead_tiles" else 1):
                bad(name, "an int >= 1" if name != "cta_overhead_tiles" else "an int >= 0")
        for name in ("ctas_per_sm", "in_kernel_merge_max"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                bad(name, "an int >= 0")
        for name in ("fill_unsplit_min_free", "tail_split_max_fill", "tail_split_min_gain", "one_wave_min_fill"):
            x = getattr(self, name)
            # tail_split_min_gain may be negative (-inf: take the tail split whatever the model says)
            low = -float("inf") if name == "tail_split_min_gain" else 0
            if isinstance(x, bool) or not isinstance(x, numbers.Real) or not low <= x <= 1:
                bad(name, "a number <= 1 (not NaN)" if low else "a number in [0, 1]")
        for name in ("tail_split_buckets", "one_wave_buckets"):
            try:
                buckets = tuple(getattr(self, name))
            except TypeError:
                buckets = None
            if buckets is None or not all(is_int(b) for b in buckets):
                bad(name, "a sequence of head-dim buckets (ints)")
            object.__setattr__(self, name, buckets)  # a tuple: the policy stays hashable


DEFAULT_DECODE_POLICY = DecodePolicy()


@dataclass(frozen=True)
class DecodePlan:
    attn: Launch  # split-KV attention: grid (num_splits * num_row_blocks, nheads_kv, batch), or split_major (nheads_kv, batch, that)
    append: Launch | None  # new tokens into the cache; None without new tokens
    num_splits: int
    num_row_blocks: int  # CTAs per (split, kv head, sequence) along the packed query rows
    combine: Launch | None = None  # merge of the splits after attn; None: one split, or merged inside attn
    ctas_per_sm: int = 0  # split CTAs resident per SM (attn's shared memory padded where below the tile's)
    split_tiles: int = 0  # K/V tiles per split, the last one taking the rest; 0: equal splits (the kernel's ceil)
    split_major: bool = False  # attn's grid is (nheads_kv, batch, splits): the last split's CTAs start last
    tail_groups: int = 0  # > 0: attn's grid is 1-D: the last tail_groups groups in num_splits splits, the rest whole


def decode_cta_loads(tile: DecodeTile, per_sm: int, policy: DecodePolicy = DEFAULT_DECODE_POLICY) -> bool:
    """Whether split CTAs of ``tile`` launched ``per_sm`` per SM load each K/V tile as a whole CTA, with
    CTA barriers (DecodeConfig::kCtaLoads), rather than per key column of warps: where the plan spaces
    a tile sized for more CTAs per SM to policy.long_ctas_per_sm (its long splits), which measured
    faster; at the tile's own CTAs per SM column loads were no slower."""
    return tile.stages > 1 and per_sm == policy.long_ctas_per_sm < tile.min_blocks


def decode_separate_combine(rows_per_cta: int, num_splits: int, policy: DecodePolicy = DEFAULT_DECODE_POLICY) -> bool:
    """Whether the combine kernel merges the splits (else the last split CTA of each group does):
    more than policy.in_kernel_merge_max partial rows per group."""
    return num_splits > 1 and rows_per_cta * num_splits > policy.in_kernel_merge_max


def decode_combine_lean(out_rows: int, num_splits: int, num_sms: int,
                        policy: DecodePolicy = DEFAULT_DECODE_POLICY) -> bool:  # fmt: skip
    """Whether the combine kernel runs lean (DecodeCombineSpec): as policy.combine says, or with "auto"
    where every warp's splits still fit one batch of DECODE_COMBINE_LEAN_BATCH (the lean kernel then
    waits as long as the wide one), or where the wide kernel's CTAs (one per output row) would take more
    than one wave of policy.combine_wide_ctas_per_sm per SM."""
    if policy.combine != "auto":
        return policy.combine == "lean"
    one_batch = num_splits <= DECODE_COMBINE_LEAN_BATCH * (DECODE_THREADS // 32)
    return one_batch or out_rows > policy.combine_wide_ctas_per_sm * num_sms


def decode_tail_grid_variant(bucket: int, m_slabs: int, arch: str, policy: DecodePolicy = DEFAULT_DECODE_POLICY) -> bool:
    """Whether a tail-split variant (DecodeSpec.tail_grid) of this bucket and slab count exists for
    ``arch``: one slab (the kernel's mapping), a bucket of policy.tail_split_buckets, sm_90+."""
    return m_slabs == 1 and bucket in policy.tail_split_buckets and supports_pdl(arch)


def decode_num_splits(*, ctas: int, n_tiles: int, slots: int, min_tiles: int, max_tiles: int = 0,
                      filled_tiles=None, overhead_tiles: int = DEFAULT_DECODE_POLICY.cta_overhead_tiles) -> int:  # fmt: skip
    """Key splits per sequence that fill the GPU: the s in [s_min, s_max] minimizing the modeled time
    ceil(ctas * s / slots) * (ceil(n_tiles / s) + overhead_tiles) (waves of resident CTAs, times the
    tiles one CTA streams plus its fixed cost), taking the smallest s within 2% of the best.
    filled_tiles(s): the tiles of a long split where s splits would be planned as a filled grid (the
    tails ride in the last wave's free slots), else None; the model then counts those instead.

    ctas: CTAs without splitting (batch * nheads_kv * row blocks); n_tiles: K/V tiles of the longest
    sequence; slots: CTAs resident at once (SMs x CTAs per SM); s_max: min(MAX_DECODE_SPLITS,
    n_tiles // min_tiles), so a split gets at least min_tiles tiles; s_min: ceil(n_tiles / max_tiles)
    (at most s_max), so a split gets at most max_tiles tiles (0: no limit).
    """
    if min(ctas, n_tiles, slots, min_tiles) < 1 or max_tiles < 0:
        raise ValueError("decode_num_splits needs positive ctas, n_tiles, slots and min_tiles, and max_tiles >= 0")
    s_max = max(1, min(MAX_DECODE_SPLITS, n_tiles // min_tiles))
    s_min = min(s_max, -(-n_tiles // max_tiles)) if max_tiles else 1

    def tiles(s: int) -> int:
        filled = filled_tiles(s) if filled_tiles else None
        return -(-n_tiles // s) if filled is None else filled

    cost = {s: -(-ctas * s // slots) * (tiles(s) + overhead_tiles) for s in range(s_min, s_max + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= best * 1.02)


def plan_decode(
    *,
    batch: int,
    seqlen_q: int,
    nheads: int,
    nheads_kv: int,
    head_dim: int,
    dtype: str,
    aligned: bool,
    max_seqlen: int,
    num_splits: int,
    num_sms: int,
    arch: str,
    seqlen_new: int = 0,
    append_aligned: bool = False,
    uniform_lengths: bool = False,
    policy: DecodePolicy = DEFAULT_DECODE_POLICY,
    mods: int = 0,
    window_left: int = -1,
) -> DecodePlan:
    """Kernels, grids and split count of one decode call (batch, seqlen_q, heads >= 1).

    max_seqlen: the most keys any sequence attends to (after the append), or an upper bound (the
    capacity) where the lengths live on the GPU. num_splits: 0 = the plan's (decode_num_splits), else
    that many, at most MAX_DECODE_SPLITS and at most one per K/V tile. num_sms: the GPU's SMs.
    uniform_lengths: every sequence attends to the same number of keys, within the last 64-key step
    below max_seqlen (one length for all, known on the host). mods: the attention variants
    (common.MOD_WINDOW | MOD_SOFTCAP | MOD_ALIBI bits); with a window, window_left >= 0: the splits
    cover only the keys the window holds (the kernel starts each sequence at its window's first tile).

    CTAs per SM of the split kernel (fewer than the tile holds by padding its shared memory,
    decode_launch_smem): policy.ctas_per_sm if set, else with num_splits=0 the split count is chosen
    for policy.long_ctas_per_sm per SM if its splits stream at least policy.long_cta_keys keys, else
    for the tile's min_blocks per SM (the count and the CTAs per SM it was chosen for stay together);
    with a given num_splits, long_ctas_per_sm where its splits are that long, else min_blocks.

    Grid shape, with uniform_lengths, num_splits=0 and no forced ctas_per_sm (the plan picks it): the
    unsplit wave (_unsplit_wave) where it applies; else the split model's plan, turned into a filled
    grid (_filled_grid), a tail-split grid (_tail_split) or a deep grid (_deep_grid) where those apply.
    Otherwise equal splits on a (splits x row blocks, nheads_kv, batch) grid.
    """
    if min(batch, seqlen_q, nheads, nheads_kv, num_sms) < 1:
        raise ValueError("plan_decode needs non-empty dimensions and num_sms >= 1; empty inputs never launch")
    if nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if num_splits < 0 or max_seqlen < 0 or seqlen_new < 0:
        raise ValueError(f"num_splits, max_seqlen and seqlen_new must be >= 0, got {num_splits}, {max_seqlen}, {seqlen_new}")
    if nheads_kv > 65535 or batch > 65535:
        raise ValueError(f"nheads_kv and batch must each be at most 65535 (grid limits), got {nheads_kv} and {batch}")
    bucket = head_dim_bucket(head_dim)
    rows = (nheads // nheads_kv) * seqlen_q
    m_slabs = decode_m_slabs(rows, bucket, arch)
    spec = decode_spec(head_dim, dtype, aligned, m_slabs, arch, mods)
    if mods & MOD_WINDOW:
        if window_left < 0:
            raise ValueError("a windowed decode plan needs window_left >= 0")
        # Keys [L - seqlen_q - window_left, L) span at most this many tiles from the window's first tile.
        max_seqlen = min(max_seqlen, seqlen_q + window_left + spec.tile.block_n)
    row_blocks = -(-rows // (16 * m_slabs))
    n_tiles = -(-max_seqlen // spec.tile.block_n)
    ctas_per_sm = policy.ctas_per_sm
    if not 0 <= ctas_per_sm <= spec.tile.min_blocks:
        raise ValueError(f"ctas_per_sm must be 0 (the tile's) or 1..{spec.tile.min_blocks}, got {ctas_per_sm!r}")
    bn = spec.tile.block_n
    spaced = min(policy.long_ctas_per_sm, spec.tile.min_blocks)
    groups = batch * nheads_kv  # (sequence, kv head) groups

    def long_ctas(s: int) -> bool:
        return -(-n_tiles // s) * bn >= policy.long_cta_keys

    own_grid = uniform_lengths and num_splits == 0 and ctas_per_sm == 0  # the plan may pick the grid's shape
    unsplit_wave = own_grid and _unsplit_wave(groups * row_blocks, n_tiles, spec, num_sms, policy)
    may_fill = own_grid and not unsplit_wave
    tail = None  # (splits, tail_groups) of a tail-split grid (_tail_split, _deep_grid)
    if unsplit_wave:
        splits, per_sm = 1, 1
    elif num_splits == 0:
        def auto(per_sm: int) -> int:
            def filled_tiles(s: int) -> int | None:  # the split count as _filled_grid below would plan it
                got = _filled_grid(groups, n_tiles, s, per_sm, row_blocks, rows, spec, num_sms, policy, for_model=True)
                return None if got is None else got[1]

            return decode_num_splits(ctas=groups * row_blocks, n_tiles=max(1, n_tiles),
                                     slots=num_sms * per_sm, min_tiles=-(-policy.min_keys_per_split // bn),
                                     max_tiles=policy.max_keys_per_split // bn,
                                     filled_tiles=filled_tiles if may_fill and n_tiles else None,
                                     overhead_tiles=policy.cta_overhead_tiles)  # fmt: skip

        # The split count and the CTAs per SM it was chosen for go together: a count picked for the
        # tile's slots is launched with them even where its splits come out long.
        per_sm = ctas_per_sm or spaced
        splits = auto(per_sm)
        if not ctas_per_sm and not long_ctas(splits):
            per_sm = spec.tile.min_blocks  # short CTAs: as many per SM as fit
            splits = auto(per_sm)
        if may_fill and splits == 1:  # the split model's whole groups, their last wave split where that pays
            tail = _tail_split(groups, n_tiles, per_sm, row_blocks, rows, spec, num_sms, policy)
        if may_fill and tail is None:
            tail = _deep_grid(groups, n_tiles, row_blocks, rows, spec, num_sms, policy)
            if tail is not None:
                per_sm, splits = spec.tile.min_blocks, 1  # whole groups and a tail split, at the tile's CTAs per SM
    else:
        splits = max(1, min(num_splits, MAX_DECODE_SPLITS, n_tiles))
        per_sm = ctas_per_sm or (spaced if long_ctas(splits) else spec.tile.min_blocks)
    block = (DECODE_THREADS, 1, 1)
    pdl = supports_pdl(arch)  # every decode kernel waits for the one before it (flash_decode.cuh)
    filled = None
    if may_fill:
        filled = _filled_grid(groups, n_tiles, splits, per_sm, row_blocks, rows, spec, num_sms, policy)
    split_tiles = tail_groups = 0
    if filled is not None:
        splits, split_tiles = filled
        grid = (nheads_kv, batch, splits)
    elif tail is not None:  # the filled grid, where both apply (one split of >= 96 tiles), takes precedence
        splits, tail_groups = tail
        grid = (groups + (splits - 1) * tail_groups, 1, 1)
        spec = dataclasses.replace(spec, tail_grid=True)
    else:
        grid = (splits * row_blocks, nheads_kv, batch)
    smem = spec.smem_bytes if per_sm == spec.tile.min_blocks else decode_launch_smem(spec.smem_bytes, per_sm, arch)
    if decode_cta_loads(spec.tile, per_sm, policy):
        spec = dataclasses.replace(spec, cta_loads=True)
    attn = Launch(spec, grid, block, smem, pdl)
    append = None
    if seqlen_new > 0:
        chunks = -(-head_dim // 8) if append_aligned else head_dim
        total = batch * seqlen_new * nheads_kv * chunks
        append = Launch(DecodeAppendSpec(bool(append_aligned), arch), (min(-(-total // DECODE_THREADS), 1 << 20), 1, 1), block,
                        0, pdl)  # fmt: skip
    combine = None
    if decode_separate_combine(min(rows, 16 * m_slabs), splits, policy):
        out_rows = batch * nheads * seqlen_q
        if out_rows > MAX_GRID_X:
            raise ValueError(f"batch * nheads * seqlen_q = {out_rows} output rows exceed the grid limit {MAX_GRID_X}")
        lean = decode_combine_lean(out_rows, splits, num_sms, policy)
        combine = Launch(DecodeCombineSpec(spec.head_dim, dtype, arch, lean), (out_rows, 1, 1), block, 0, pdl)
    return DecodePlan(attn, append, splits, row_blocks, combine, per_sm, split_tiles, filled is not None, tail_groups)


def _unsplit_wave(ctas: int, n_tiles: int, spec: DecodeSpec, num_sms: int, policy: DecodePolicy) -> bool:
    """Whether ``ctas`` unsplit CTAs (groups x row blocks) of ``n_tiles`` tiles run as the unsplit wave:
    every group whole, one CTA per SM (shared memory padded), where they give a CTA to at least
    policy.one_wave_min_fill of the SMs and no SM a second: no partial rows, no merge, one start per
    SM. For the measured buckets, one slab, the 16-byte path, sm_90+, groups of long_cta_keys to
    max_keys_per_split keys; with ragged lengths the longest group would set the time (uniform only)."""
    if not (supports_pdl(spec.arch) and spec.head_dim in policy.one_wave_buckets and spec.m_slabs == 1
            and spec.aligned):
        return False
    keys = n_tiles * spec.tile.block_n
    return (policy.one_wave_min_fill * num_sms <= ctas <= num_sms
            and policy.long_cta_keys <= keys <= policy.max_keys_per_split)


def _filled_grid(groups: int, n_tiles: int, splits: int, per_sm: int, row_blocks: int, rows: int, spec: DecodeSpec,
                 num_sms: int, policy: DecodePolicy, *, for_model: bool = False) -> tuple[int, int] | None:  # fmt: skip
    """(splits, tiles per split) of the filled grid where it replaces the split plan's (splits, per_sm)
    grid of equal splits, else None. for_model: as the split count's model prices it, without the
    nearly-full rule for one split (policy.fill_unsplit_min_free), so that rule decides how a
    one-split count runs (filled or whole), never the count itself.

    The ``splits`` long splits of every group run in waves of ``slots`` CTAs; the last wave leaves
    ``free`` slots empty, through which the groups' tails go in rounds = ceil(groups / free) one
    after another while that wave runs, so a tail gets about 1 / rounds of a long split: the long
    splits get B = ceil(n_tiles * rounds / (splits * rounds + 1)) tiles, the tail the rest, and the
    rounds of tails end before the last wave of long splits does. The grid is split-major, so the
    block scheduler (by its usual order, not a CUDA guarantee: only the speed depends on it) starts
    the tails last."""
    slots = num_sms * policy.long_ctas_per_sm
    free = -(-splits * groups // slots) * slots - splits * groups  # slots the long splits leave empty in their last wave
    if not (supports_pdl(spec.arch) and row_blocks == 1 and per_sm == policy.long_ctas_per_sm and free > 0):
        return None
    rounds = -(-groups // free)
    if rounds == 1:  # a free slot for every tail: that is one more equal split, not a filled grid
        return None
    long_tiles = -(-n_tiles * rounds // (splits * rounds + 1))
    tail = n_tiles - splits * long_tiles
    if splits > 1:
        need = -(-policy.long_cta_keys // spec.tile.block_n)
    elif not for_model and free < policy.fill_unsplit_min_free * slots:
        need = policy.fill_min_unsplit_tiles_full
    else:
        need = policy.fill_min_unsplit_tiles
    if tail < 1 or long_tiles < need or rounds * tail > long_tiles:
        return None
    if splits + 1 > MAX_DECODE_SPLITS or decode_separate_combine(rows, splits + 1, policy):
        return None
    return splits + 1, long_tiles


def _tail_split(groups: int, n_tiles: int, per_sm: int, row_blocks: int, rows: int, spec: DecodeSpec,
                num_sms: int, policy: DecodePolicy) -> tuple[int, int] | None:  # fmt: skip
    """(splits, tail_groups) of the tail-split grid where it replaces a one-split grid of ``groups``
    whole groups of ``n_tiles`` tiles at ``per_sm`` CTAs per SM, else None.

    The whole groups run in ``waves`` full waves of ``slots`` CTAs; the ``tail`` groups left over
    would run as one more wave with slots empty (a few long CTAs running on alone). Split s ways,
    they are tail * s CTAs of ceil(n_tiles / s) tiles in ceil(tail * s / slots) waves of their own,
    started last. s: at least 2, at most MAX_DECODE_SPLITS, splits of at least min_keys_per_split
    keys, merged in the kernel (at most in_kernel_merge_max partial rows); the modeled cheapest, the
    smallest of equals. Only where a kTailGrid variant exists (decode_tail_grid_variant), in one row
    block, after policy.tail_split_min_waves whole waves, a last wave at most tail_split_max_fill full,
    tail_split_min_tiles tiles a group, and tail_split_min_gain of the modeled time saved."""
    slots = num_sms * per_sm
    waves, tail = divmod(groups, slots)
    if not (decode_tail_grid_variant(spec.head_dim, spec.m_slabs, spec.arch, policy) and row_blocks == 1 and tail > 0):
        return None
    if waves < policy.tail_split_min_waves or tail > policy.tail_split_max_fill * slots:
        return None
    if n_tiles < policy.tail_split_min_tiles:
        return None
    over = policy.cta_overhead_tiles

    def last_waves(s: int) -> int:  # the tail groups' time in the model, in tiles
        return -(-tail * s // slots) * (-(-n_tiles // s) + over) + (over if s > 1 else 0)

    s_max = min(MAX_DECODE_SPLITS, n_tiles // -(-policy.min_keys_per_split // spec.tile.block_n))
    options = [s for s in range(2, s_max + 1) if not decode_separate_combine(rows, s, policy)]
    if not options:
        return None
    best = min(options, key=lambda s: (last_waves(s), s))
    whole = waves * (n_tiles + over)
    if whole + last_waves(best) > (1 - policy.tail_split_min_gain) * (whole + last_waves(1)):
        return None
    if groups + (best - 1) * tail > MAX_GRID_X:
        return None
    return best, tail


def _deep_grid(groups: int, n_tiles: int, row_blocks: int, rows: int, spec: DecodeSpec, num_sms: int,
               policy: DecodePolicy) -> tuple[int, int] | None:  # fmt: skip
    """(splits, tail_groups) of the tail split where ``groups`` whole groups of ``n_tiles`` tiles run
    at the tile's min_blocks CTAs per SM rather than as the split model plans them, else None: the
    tile holds more CTAs per SM than policy.long_ctas_per_sm, the groups fill at least
    policy.deep_min_waves waves at min_blocks per SM, are at most policy.deep_max_keys keys, and
    _tail_split takes the last wave. At 3 per SM a CTA's start and end are covered by the two others
    on its SM; the split model sees neither that nor the tail split."""
    per_sm = spec.tile.min_blocks
    if per_sm <= policy.long_ctas_per_sm or n_tiles * spec.tile.block_n > policy.deep_max_keys:
        return None
    if groups < policy.deep_min_waves * num_sms * per_sm:
        return None
    return _tail_split(groups, n_tiles, per_sm, row_blocks, rows, spec, num_sms, policy)


def all_decode_specs(arch: str, head_dims=HEAD_DIM_BUCKETS, dtypes=DTYPES, causals=None, aligned=(True, False),
                     m_slabs=DECODE_M_SLABS, policy: DecodePolicy = DEFAULT_DECODE_POLICY, mods=(0,)):  # fmt: skip
    """Every decode variant (split-KV attention, combine, append) for ``arch`` that ``policy`` can
    launch. ``causals`` is accepted for the precompile command's uniform call and ignored: causal is
    a run-time flag in decode. ``mods``: the variant combinations (dropout bits are skipped: decode
    has none)."""
    mods = tuple(dict.fromkeys(m & ALL_MODS & ~MOD_DROPOUT for m in mods))  # no dropout, no varlen in decode
    specs: list = []
    for dt in dtypes:
        for d in head_dims:
            bucket = head_dim_bucket(d)
            fitting = decode_m_slabs_options(bucket, arch)
            for al in aligned:
                for m in m_slabs:
                    if m in fitting:
                        tile = decode_tile(bucket, m, arch)
                        for mo in mods:
                            specs.append(DecodeSpec(bucket, dt, al, m, tile, arch, mods=mo))
                            if decode_cta_loads(tile, policy.long_ctas_per_sm, policy):  # the plan's long splits
                                specs.append(DecodeSpec(bucket, dt, al, m, tile, arch, cta_loads=True, mods=mo))
                            if decode_tail_grid_variant(bucket, m, arch, policy):  # _tail_split's, at both CTAs per SM
                                specs += [DecodeSpec(bucket, dt, al, m, tile, arch, cta_loads=c, tail_grid=True, mods=mo)
                                          for c in sorted({False, decode_cta_loads(tile, policy.long_ctas_per_sm, policy)})]
    specs += [DecodeCombineSpec(head_dim_bucket(d), dt, arch, lean) for dt in dtypes for d in head_dims
              for lean in (False, True)]
    specs += [DecodeAppendSpec(al, arch) for al in aligned]
    specs += [RotarySpec(dt, il, arch) for dt in dtypes for il in (False, True)]
    return list(dict.fromkeys(specs))
