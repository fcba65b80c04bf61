// FlashAttention-2 forward (Dao 2023, Algorithm 1) on tensor cores with mma.sync (sm_80 and newer).
//
// Computes, for one (batch b, query head h) and a tile of kBlockM query rows,
//     O = softmax(scale * Q K^T + mask) V      lse = log(sum_j exp(scale * q.k_j))   (natural log)
// without ever writing the kBlockM x seqlen_k score matrix to global memory.
//
// Grid and tiles
//   grid  = (ceil(seqlen_q / kBlockM), nheads, batch); CTA (m, h, b) owns query rows
//           [m*kBlockM, (m+1)*kBlockM) of head h. Causal grids run the heaviest row tiles first.
//   block = kNWarps warps. Warp w owns kRowsPerWarp = kBlockM / kNWarps consecutive query rows
//           (kMSlabs slabs of 16 rows, one MMA row block each). All warps share the K and V
//           tiles: no warp ever needs another warp's partial results (paper section 3.3).
//   smem  = sQ[kBlockM][kHeadDim+8] + kStages x (sK[kBlockN][kHeadDim+8] + sV[...]).
//           Rows are padded by 16 bytes so the 8 row addresses of an ldmatrix hit 8 distinct
//           16-byte bank groups (stride of an odd number of 16-byte units: conflict free).
//   K/V tiles are walked from the last visible block down to block 0. The blocks that need a
//   mask (causal diagonal, ragged end of seqlen_k) therefore come first; the rest run mask-free.
//   kStages == 2: while tile j is used, cp.async brings tile j-1 into the other stage (one barrier
//   per tile). kStages == 1 (FA2's order; the tile table picks it where it measured faster, or where
//   two stages would not fit twice per SM): V_j streams in during S = Q K_j^T and K_{j-1} during the
//   softmax and P V_j (two barriers).
//   Epilogue: each warp stages its normalized O rows in its own rows of sQ and writes them out in
//   coalesced 16-byte chunks.
//
// Per thread (g = lane / 4, t = lane % 4) for each slab s and half r (row g or g + 8):
//   acc_o[s][d/8][2r..2r+1]: unnormalized O, fp32     row_max[s][r]: running max m (raw score units)
//   row_sum[s][r]: this thread's part of the running sum l (the 4 threads of a quad are added once, at the end)
// Online softmax per K/V tile (paper Algorithm 1, lines 8-10):
//   m_new = max(m, rowmax(S));  P = exp2(S * scale_log2 - m_new * scale_log2)
//   l = l * exp2((m - m_new) * scale_log2) + rowsum(P);  O = O * exp2(...) + P V
//   (O is rescaled only when some row of the warp got a new max: the factor is exactly 1 otherwise)
//   and only after the last tile: O /= l (the one division of FA2), lse = m * scale + ln(l).
// P goes from the S accumulator registers straight into the A operand of P V (no smem round trip).
//
// Variants (Cfg::kMods, masks.cuh / dropout.cuh; docs/design/variants.md): softcap and ALiBi modify S
// before the mask, a window narrows the K/V blocks visited to [first_block(), n_block_end) and masks both
// edges, dropout zeroes probabilities after the softmax's row sums (keep bits drawn before S = Q K^T).
//
// Preconditions (checked in Python, cuflash/checks.py and cuflash/forward.py): head_dim <= kHeadDim; kAligned variants
// need 16-byte aligned rows (base pointers % 16 == 0, strides % 8 elements, head_dim % 8 == 0);
// softmax_scale > 0; seqlen_q, seqlen_k >= 1.
#pragma once

#include "masks.cuh"
#include "params.h"
#include "primitives.cuh"
#include "warp_tile.cuh"

namespace cuflash {

// Compile-time shape of one kernel variant. Tile choices come from cuflash/plan/forward.py (FWD_TILES).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kIsBF16_, bool kIsCausal_,
          bool kAligned_, bool kQInRegs_, int kStages_, int kMods_ = 0>
struct FwdConfig {
    static constexpr int kHeadDim = kHeadDim_;   // head-dim bucket (multiple of 32)
    static constexpr int kBlockM = kBlockM_;     // query rows per CTA
    static constexpr int kBlockN = kBlockN_;     // key rows per K/V tile
    static constexpr int kNWarps = kNWarps_;
    static constexpr bool kIsBF16 = kIsBF16_;
    static constexpr bool kIsCausal = kIsCausal_;
    static constexpr bool kAligned = kAligned_;  // 16-byte cp.async loads; else element-wise loads
    static constexpr bool kQInRegs = kQInRegs_;  // Q fragments loaded once into registers
    static constexpr int kStages = kStages_;     // smem buffers per K and per V tile (1 or 2)
    static constexpr int kMods = kMods_;         // attention variants (masks.cuh kMod* bits)

    static constexpr int kNThreads = kNWarps * 32;
    static constexpr int kRowsPerWarp = kBlockM / kNWarps;
    static constexpr int kMSlabs = kRowsPerWarp / 16;  // 16-row MMA blocks per warp
    static constexpr int kNBlocksS = kBlockN / 8;      // 8-column MMA blocks of S
    static constexpr int kDBlocks = kHeadDim / 8;      // 8-column MMA blocks of O
    static constexpr int kKStepsQK = kHeadDim / 16;    // k-steps of S = Q K^T
    static constexpr int kKStepsPV = kBlockN / 16;     // k-steps of O += P V
    static constexpr int kSmemStride = kHeadDim + 8;   // elements per smem row (16 bytes pad)
    static constexpr bool kKVSwizzled = false;         // K/V rows padded like Q (WarpTile, kv_chunk_offset)
    static constexpr int kKVStride = kSmemStride;      // elements between K/V rows in smem
    static constexpr int kChunksPerRow = kHeadDim / 8; // 16-byte chunks per row
    static constexpr int kSmemQ = kBlockM * kSmemStride;
    static constexpr int kSmemKV = kBlockN * kSmemStride;
    static constexpr int kSmemBytes = 2 * (kSmemQ + 2 * kStages * kSmemKV);  // Q + kStages x (K, V)

    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head-dim buckets are multiples of 32");
    static_assert(kBlockM % (16 * kNWarps) == 0, "every warp owns whole 16-row MMA slabs");
    static_assert(kBlockN % 16 == 0, "K/V tiles are whole MMA k-steps");
    static_assert((kSmemStride / 8) % 2 == 1, "odd 16-byte row stride keeps ldmatrix conflict free");
    static_assert(kStages == 1 || kStages == 2, "K/V tiles are single or double buffered");
};


// q = n / f.d, r = n % f.d for 0 <= n < 2^31 (params.h FastDiv): floor(n * mul / 2^(31 + l)) is exact for
// every such n when mul = ceil(2^(31 + l) / d), l = ceil(log2 d) (Granlund and Montgomery 1994, round-up
// multiplier); tests/test_params_layout.py checks the host's multipliers against Python's // over the range.
CUFLASH_DEVICE int fast_div(const FastDiv& f, int n) { return f.d == 1 ? n : (int)(__umulhi((u32)n, f.mul) >> f.shift); }
CUFLASH_DEVICE void fast_divmod(const FastDiv& f, int n, int& q, int& r) {
    q = fast_div(f, n);
    r = n - q * f.d;
}

// A forward CTA's values of the variants: the first K/V block it visits (window), the ALiBi slope of
// its head and its dropout stream. Empty for plain variants, whose CTA state (and code) stay as they were.
template <int kMods>
struct FwdModState {
    int n_block_begin;
    float alibi_slope;  // raw-score units
    DropoutStream rng;
};
template <>
struct FwdModState<0> {};

// What a forward CTA works on: query tile m of head h in batch b (blockIdx, or a persistent CTA's work
// item), its rows of Q, O and lse, its kv head's K and V, the K/V blocks [first_block(), n_block_end)
// it visits, and the variants' values (FwdModState). Varlen (varlen.cuh): the x index is a scheduler slot that names
// sequence b and its tile m, or nothing (skip()).
template <class Cfg>
struct FwdTileRef : FwdModState<Cfg::kMods> {
    using Mask = AttnMask<Cfg::kIsCausal, Cfg::kMods>;
    static constexpr bool kMods = (Cfg::kMods & kModScores) != 0;
    static constexpr bool kVarlen = (Cfg::kMods & kModVarlen) != 0;
    const u16 *q, *k, *v;  // q: row m0 of the tile; k, v: key 0 of kv head h / head_ratio
    u16* o;
    float* lse;
    int m0, rows_valid, n_block_end;
    Mask mask;
    int seqlen_k_;  // varlen: the sequence's keys
    bool skip_;     // varlen: a spare slot of the scheduler
    const int* bt_row_;  // varlen with paged K/V: the sequence's block_table row (else null)
    // Coordinates of the tile in the tensor maps of the TMA kernels (flash_fwd_sm90_ws.cuh), whose maps
    // see q / k / v as 4-D (batch, rows, heads, columns): plain batches (b, m0 / 0, h / hk); varlen
    // (0, the sequence's first packed row + m0 / its first key row, h / hk); paged K/V: kv_coords.
    int tma_b, tma_h, tma_hk, q_row0, k_row0;

    CUFLASH_DEVICE explicit FwdTileRef(const FwdParams& p) : FwdTileRef(p, blockIdx.x, blockIdx.y, blockIdx.z) {}

    // The tile of grid index (x, y, z): blockIdx, or the work item a persistent CTA took.
    CUFLASH_DEVICE FwdTileRef(const FwdParams& p, int x, int y, int z) : mask(p.mod, p.seqlen_q, p.seqlen_k) {
        if constexpr (kVarlen) {
            init_varlen(p, x, y);
            return;
        }
        // Causal row tiles differ in cost (tile m visits about m+1 K/V blocks): launch the heavy ones first.
        const int m_block = Cfg::kIsCausal ? p.num_m_blocks - 1 - x : x;
        const int h = y, b = z;
        const int hk = fast_div(p.kv_ratio, h);  // GQA: query head h reads kv head h / (nheads / nheads_kv)
        m0 = m_block * Cfg::kBlockM;
        // 64-bit offsets: batch * batch_stride and m0 * row_stride can exceed 2^31 elements.
        q = static_cast<const u16*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + m0 * p.q_row_stride;
        k = static_cast<const u16*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
        v = static_cast<const u16*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
        o = static_cast<u16*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride + m0 * p.o_row_stride;
        lse = p.lse + ((i64)b * p.nheads + h) * p.seqlen_q + m0;
        tma_b = b, tma_h = h, tma_hk = hk, q_row0 = m0, k_row0 = 0;
        n_block_end = mask.n_block_end(m0, Cfg::kBlockM, Cfg::kBlockN);
        rows_valid = min(Cfg::kBlockM, p.seqlen_q - m0);
        if constexpr (kMods) {
            this->n_block_begin = mask.n_block_begin(m0, Cfg::kBlockN);
            this->alibi_slope = Mask::alibi_slope(p.mod, b, h);
            this->rng = DropoutStream(p.mod.seed, p.mod.offset, b, p.nheads, h, p.mod.keep_threshold);
        }
    }

    // Varlen (varlen.cuh): blockIdx.x is a scheduler slot naming sequence b and its query tile (the
    // heaviest first with causal), or nothing (skip()); rows, lengths and lse from the prefix sums.
    CUFLASH_DEVICE void init_varlen(const FwdParams& p, int x, int y) {
        const VarlenTile<FwdParams> slot(p, false, Cfg::kBlockM, Cfg::kBlockM, Cfg::kIsCausal, x);
        const SeqInfo<true>& seq = slot.seq;
        skip_ = slot.skip;
        seqlen_k_ = seq.seqlen_k;
        bt_row_ = seq.bt_row;
        mask = Mask(p.mod, seq.seqlen_q, seq.seqlen_k);
        const int h = y, b = seq.b;
        const int hk = fast_div(p.kv_ratio, h);
        m0 = slot.m_block * Cfg::kBlockM;
        q = static_cast<const u16*>(p.q) + seq.q_off(0, p.q_row_stride) + h * p.q_head_stride + m0 * p.q_row_stride;
        k = static_cast<const u16*>(p.k) + seq.k_off(0, p.k_row_stride) + hk * p.k_head_stride;
        v = static_cast<const u16*>(p.v) + seq.k_off(0, p.v_row_stride) + hk * p.v_head_stride;
        o = static_cast<u16*>(p.o) + seq.q_off(0, p.o_row_stride) + h * p.o_head_stride + m0 * p.o_row_stride;
        lse = p.lse + seq.lse_row(p, h) + m0;
        tma_b = 0, tma_h = h, tma_hk = hk, q_row0 = seq.q_start + m0, k_row0 = seq.k_start;
        n_block_end = mask.n_block_end(m0, Cfg::kBlockM, Cfg::kBlockN);
        rows_valid = min(Cfg::kBlockM, seq.seqlen_q - m0);
        if constexpr (kMods) {
            this->n_block_begin = mask.n_block_begin(m0, Cfg::kBlockN);
            this->alibi_slope = Mask::alibi_slope(p.mod, b, h);
            this->rng = DropoutStream(p.mod.seed, p.mod.offset, b, p.nheads, h, p.mod.keep_threshold);
        }
    }

    // Key tile n0 of K (or V: its strides) from k (or v): packed rows; varlen with paged K/V, its page.
    CUFLASH_DEVICE const u16* kv_tile(const FwdParams& p, const u16* base, int n0, i64 batch_stride, i64 row_stride) const {
        if constexpr (kVarlen) {
            return base + varlen_kv_tile_off(p.mod, bt_row_, n0, batch_stride, row_stride);
        } else {
            return base + n0 * row_stride;
        }
    }

    // Tensor-map row and batch coordinates of key tile n0: (k_row0 + n0, tma_b); paged K/V (varlen with a
    // block table): (slot, page) of the page holding the tile, the page index clamped as kv_tile does.
    CUFLASH_DEVICE void kv_coords(const FwdParams& p, int n0, int& row, int& batch) const {
        if constexpr (kVarlen) {
            if (bt_row_ != nullptr) {
                const int blk = n0 / p.mod.page_size;
                batch = min(max(__ldg(bt_row_ + blk), 0), p.mod.num_pages - 1);
                row = n0 - blk * p.mod.page_size;
                return;
            }
        }
        row = k_row0 + n0;
        batch = tma_b;
    }

    // Keys of the CTA's sequence.
    CUFLASH_DEVICE int keys(const FwdParams& p) const {
        if constexpr (kVarlen) {
            return seqlen_k_;
        } else {
            return p.seqlen_k;
        }
    }
    // Varlen: this slot has no tile (a spare slot of the scheduler); the CTA exits at once.
    CUFLASH_DEVICE bool skip() const {
        if constexpr (kVarlen) {
            return skip_;
        } else {
            return false;
        }
    }

    // K/V blocks [first_block(), n_block_end) are visited.
    CUFLASH_DEVICE int first_block() const {
        if constexpr (Mask::kWindow) {
            return this->n_block_begin;
        } else {
            return 0;
        }
    }
    // No row of this tile sees any key: O = 0 and lse = -inf (write_empty).
    CUFLASH_DEVICE bool empty() const {
        if constexpr (Mask::kWindow) {
            return n_block_end <= this->n_block_begin;
        } else {
            return n_block_end == 0;
        }
    }

    // Softcap and ALiBi on a score tile (S as WarpTile holds it, rows from row_abs0, this thread's first
    // column col0); nothing without them. The mask (mask.apply) comes after.
    template <int kMSlabs, int kNB>
    CUFLASH_DEVICE void modify_scores(float (&S)[kMSlabs][kNB][4], int row_abs0, int col0) const {
        if constexpr (kMods) mask.modify_tile(S, row_abs0, col0, this->alibi_slope);
    }
    // Dropout keep bits of K/V block j (the warp's rows from row16), drawn before the block's scores
    // exist so the Philox work overlaps the S = Q K^T matrix product; applied after the softmax (drop).
    // Nothing without dropout.
    template <int kMSlabs, int kPairs>
    CUFLASH_DEVICE void draw_keep(u32 (&bits)[kMSlabs][kPairs], int j, int row16, int lane) const {
        if constexpr (Mask::kDropout) dropout_bits<kMSlabs, 2 * kPairs>(bits, this->rng, row16, j * Cfg::kBlockN, lane);
    }
    template <int kMSlabs, int kNB>
    CUFLASH_DEVICE void drop(float (&S)[kMSlabs][kNB][4], const u32 (&bits)[kMSlabs][kNB / 2]) const {
        if constexpr (Mask::kDropout) dropout_apply(S, bits);
    }

    // No row sees any key (empty()): O = 0 and lse = -inf.
    CUFLASH_DEVICE void write_empty(const FwdParams& p, int tid, int threads = Cfg::kNThreads) const {
        for (int i = tid; i < rows_valid * p.head_dim; i += threads) {
            o[(i / p.head_dim) * p.o_row_stride + i % p.head_dim] = 0;
        }
        for (int i = tid; i < rows_valid; i += threads) lse[i] = -kInf;
    }
};

template <class Cfg>
CUFLASH_DEVICE void flash_fwd_kernel(const FwdParams& p) {
    constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
    constexpr int kMSlabs = Cfg::kMSlabs, kNB = Cfg::kNBlocksS;
    constexpr int kStride = Cfg::kSmemStride;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const FwdTileRef<Cfg> tile(p);
    const u16 *g_q = tile.q, *g_k = tile.k, *g_v = tile.v;
    u16* g_o = tile.o;
    float* g_lse = tile.lse;
    const int m0 = tile.m0, rows_valid = tile.rows_valid, n_block_end = tile.n_block_end;
    constexpr bool kWindow = FwdTileRef<Cfg>::Mask::kWindow;
    const int n_first = tile.first_block();  // (window) K/V tiles n_last down to n_first are visited, else down to 0
    const typename FwdTileRef<Cfg>::Mask mask = tile.mask;
    const int warp_row0 = warp * Cfg::kRowsPerWarp;  // first row of this warp inside the tile
    if constexpr (FwdTileRef<Cfg>::kVarlen) {
        if (tile.skip()) return;  // a spare slot of the varlen scheduler
    }
    if (tile.empty()) {
        tile.write_empty(p, tid);
        return;
    }

    extern __shared__ __align__(16) unsigned char smem_raw[];
    u16* s_q = reinterpret_cast<u16*>(smem_raw);
    u16* s_k0 = s_q + Cfg::kSmemQ;                     // K stages: tile j lives in stage j % kStages
    u16* s_v0 = s_k0 + Cfg::kStages * Cfg::kSmemKV;    // V stages: tile j lives in stage j % kStages
    auto s_k = [&](int j) { return s_k0 + (Cfg::kStages == 2 ? (j & 1) : 0) * Cfg::kSmemKV; };
    auto s_v = [&](int j) { return s_v0 + (Cfg::kStages == 2 ? (j & 1) : 0) * Cfg::kSmemKV; };
    auto load_k = [&](int j) {
        const int n0 = j * kBlockN;
        if constexpr (FwdTileRef<Cfg>::kVarlen) {  // (paged K/V: the tile's page)
            load_tile<Cfg, kBlockN>(s_k(j), tile.kv_tile(p, g_k, n0, p.k_batch_stride, p.k_row_stride), p.k_row_stride,
                                    tile.keys(p) - n0, p.head_dim, tid);
        } else {
            load_tile<Cfg, kBlockN>(s_k(j), g_k + n0 * p.k_row_stride, p.k_row_stride, p.seqlen_k - n0, p.head_dim, tid);
        }
    };
    auto load_v = [&](int j) {
        const int n0 = j * kBlockN;
        if constexpr (FwdTileRef<Cfg>::kVarlen) {
            load_tile<Cfg, kBlockN>(s_v(j), tile.kv_tile(p, g_v, n0, p.v_batch_stride, p.v_row_stride), p.v_row_stride,
                                    tile.keys(p) - n0, p.head_dim, tid);
        } else {
            load_tile<Cfg, kBlockN>(s_v(j), g_v + n0 * p.v_row_stride, p.v_row_stride, p.seqlen_k - n0, p.head_dim, tid);
        }
    };

    WarpTile<Cfg> wt;
    wt.init(warp_row0, lane);
    const float scale_log2 = p.scale_log2;
    const int row_abs0 = m0 + warp_row0 + g;  // absolute query row of this thread's slab 0, half 0
    const int n_last = n_block_end - 1;
    float S[kMSlabs][kNB][4];                 // scores, then probabilities, of the current tile
    u32 keep[kMSlabs][kNB / 2];               // dropout keep bits of the current tile (dropout only)

    // Prologue: Q and the first K tile in one cp.async group, its V tile in the next, so S = Q K^T
    // can start before V has arrived.
    load_tile<Cfg, kBlockM>(s_q, g_q, p.q_row_stride, rows_valid, p.head_dim, tid);
    load_k(n_last);
    cp_async_commit();
    if constexpr (Cfg::kStages == 2) {
        load_v(n_last);
        cp_async_commit();
    }
    if constexpr (Cfg::kQInRegs) {
        cp_async_wait<Cfg::kStages == 2 ? 1 : 0>();
        __syncthreads();  // Q tile in smem for every warp before ldmatrix
        wt.load_q_frags(s_q);
    }

    for (int j = n_last; j >= 0; --j) {
        if constexpr (kWindow) {
            if (j < n_first) break;  // the window's first block was the last one
        }
        const bool first = j == n_last;
        if constexpr (Cfg::kStages == 2) {
            // Double buffered, one barrier per tile: tile j-1 streams into the other stage while tile
            // j is used. In flight here: V_j on the first tile (its own group), else nothing else.
            if (first) cp_async_wait<1>(); else cp_async_wait<0>();
            // K_j (and V_j after the first tile) visible to every warp; every warp has finished tile
            // j+1, so the stage of tile j+1 is free for tile j-1.
            __syncthreads();
            if (kWindow ? j > n_first : j > 0) {
                load_k(j - 1);
                load_v(j - 1);
            }
            cp_async_commit();
            tile.draw_keep(keep, j, m0 + warp_row0, lane);
            wt.gemm_qk(S, s_q, s_k(j));
            tile.modify_scores(S, row_abs0, j * kBlockN + 2 * t);
            if (mask.block_needs_mask(m0, kBlockM, j * kBlockN, kBlockN)) mask.apply(S, row_abs0, j * kBlockN + 2 * t);
            wt.softmax(S, scale_log2);
            tile.drop(S, keep);
            if (first) {
                cp_async_wait<1>();  // V_{n_last} landed (the prefetch of tile j-1 may still be in flight)
                __syncthreads();     // ... and is visible to every warp
            }
            wt.gemm_pv(S, s_v(j));
        } else {
            // Single buffered (FA2's order, two barriers per tile): V_j streams in during S = Q K_j^T,
            // K_{j-1} during the softmax and O += P V_j.
            cp_async_wait<0>();
            __syncthreads();  // K_j visible to every warp; every warp is done with V_{j+1}
            load_v(j);
            cp_async_commit();
            tile.draw_keep(keep, j, m0 + warp_row0, lane);
            wt.gemm_qk(S, s_q, s_k(j));
            tile.modify_scores(S, row_abs0, j * kBlockN + 2 * t);
            if (mask.block_needs_mask(m0, kBlockM, j * kBlockN, kBlockN)) mask.apply(S, row_abs0, j * kBlockN + 2 * t);
            cp_async_wait<0>();
            __syncthreads();  // V_j visible to every warp; every warp is done with K_j
            if (kWindow ? j > n_first : j > 0) load_k(j - 1);
            cp_async_commit();
            wt.softmax(S, scale_log2);
            tile.drop(S, keep);
            wt.gemm_pv(S, s_v(j));
        }
    }

    // Each warp stages its O rows in its own rows of sQ (only this warp ever read them).
    wt.template store<(Cfg::kMods & kModDropout) != 0>(g_o, p.o_row_stride, g_lse, p.softmax_scale, warp_row0, rows_valid, p.head_dim, s_q + warp_row0 * kStride, lane,
             p.mod.dropout_rp);
}

}  // namespace cuflash
