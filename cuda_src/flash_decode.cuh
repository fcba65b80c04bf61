// Decode with a KV cache: split-KV attention (Flash-Decoding; Dao, Haziza, Massa, Sizov 2023) on
// tensor cores with mma.sync (sm_80 and newer), plus the in-place append of new tokens.
//
// Computes, for every sequence b, query token i < seqlen_q and query head h (kv head hk = h / group)
//     O[b,i,h] = softmax(scale * q K_b^T + mask) V_b      lse[b,h,i] = log(sum_j exp(scale * q.k_j))
// over the first L_b = min(clamp(cache_seqlens[b], 0, capacity) + seqlen_new, capacity) keys of
// sequence b. Causal aligns the queries to the end: token i sees keys j <= L_b - seqlen_q + i.
// A query that sees no key gets O = 0 and lse = -inf.
//
// Up to three kernels, launched in this order on one stream (cuflash/kvcache.py):
//   1. flash_decode_append_kernel (flash_decode_append.cuh): new k, v tokens -> cache positions
//      clamp(cache_seqlens[b], 0, capacity) + t, positions at or past capacity dropped (only when new
//      tokens are given). One thread per 16-byte chunk (or element) of a new row.
//   2. flash_decode_kernel (this file): split s of the keys of (b, hk) -> partial O (fp32,
//      normalized) and its lse, or, with one split, the final O and lse directly. With several splits, the partial rows
//      are merged: O = sum_s exp(lse_s - lse) O_s with lse = log sum_s exp(lse_s), either
//      - in this kernel, by the last CTA of each (b, hk, row block) to finish, on the group's rows
//        (decode_merge.cuh decode_merge_rows; p.split_counters set). That saves a launch and the
//        gap between two kernels, which a decode step of a few tens of microseconds feels; or
//   3. flash_decode_combine_kernel (flash_decode_combine.cuh; p.split_counters null): one CTA per output row, for groups with
//      many partial rows (cuflash/plan/decode.py decode_separate_combine): one CTA merging them all at the
//      end of the split kernel, on an SM still streaming other CTAs' tiles, is the longer wait.
// On sm_90+ every one is launched with programmatic dependent launch: each waits (griddepcontrol)
// for the kernel before it on the stream to finish before touching global memory, and lets the
// kernel after it start its CTAs early, so the launch gap between them overlaps the tail of a grid.
//
// Grid and tiles of flash_decode_kernel
//   grid  = (num_splits * num_row_blocks, nheads_kv, batch); CTA (x, hk, b) owns split x / num_row_blocks
//           of the keys and packed query rows [rb * kBlockM, (rb + 1) * kBlockM), rb = x % num_row_blocks.
//   Packed rows: the group * seqlen_q query rows that read kv head hk, row r = i * group + j for
//           token i and query head hk * group + j. They fill the M dimension of the m16n8k16 MMAs
//           (padded to kBlockM = 16 * kMSlabs with zero rows), so each K/V byte is read from memory
//           once per kv-head group, not once per query head. Decode is memory bound: padded rows cost
//           tensor-core cycles that would idle anyway.
//   Keys: L_b is cut into kBlockN-key tiles; split s takes tiles [s * T, (s + 1) * T), T = ceil(tiles
//           / num_splits): the last splits may get fewer tiles or none (an empty split writes lse = -inf).
//   Filled grid (p.split_tiles > 0, p.split_major; cuflash/plan/decode.py _filled_grid): T = split_tiles, so
//           the last split is a short tail, and the grid is (nheads_kv, batch, num_splits): the long
//           splits fill all but a few CTA slots at once and the tails stream through the rest meanwhile
//           (a grid of 256 equal CTAs leaves 8 of the H200's 264 slots idle for the whole call).
//   Tail-split grid (kTailGrid variants, one slab; cuflash/plan/decode.py _tail_split): a 1-D grid for calls
//           of many unsplit groups in several waves. Group g = b * nheads_kv + hk (kv heads fastest, as
//           in the regular grid); CTA c < G0 = batch * nheads_kv - tail_groups takes group c whole (no
//           merge), CTA G0 + k split k / tail_groups of group G0 + k % tail_groups, one of num_splits
//           equal splits. The block scheduler starts the tail groups' short splits last, so they spread
//           over the slots the whole groups' last wave leaves empty instead of a few whole groups
//           running on after the rest have finished.
//   block = 4 warps as kWarpsM x kWarpsN = kMSlabs x (4 / kMSlabs). Warp (wm, wn) owns the 16 rows of
//           slab wm and keys [wn * kKeysPerWarp, (wn + 1) * kKeysPerWarp) of every tile: its own
//           online softmax (m, l, O) over its keys, FA2's per-warp steps (warp_tile.cuh WarpTile).
//           The kWarpsN partial results of a row are merged once, at the end, through shared memory.
//   smem  = sQ[kBlockM][kHeadDim+8] + m, l [kWarpsN][kBlockM] + kStages x (sK[kBlockN][kKVStride],
//           sV[...]); the fp32 merge buffer [kWarpsN][kBlockM][kHeadDim+8] reuses the K/V stages.
//           K/V rows are unpadded with XOR-swizzled 16-byte chunks for head dims that are multiples
//           of 64 (kKVStride = kHeadDim), padded otherwise (warp_tile.cuh kv_chunk_offset).
//   Pipeline: kStages-deep cp.async ring of 16-byte chunks. A stage is refilled (with the tile kStages
//           ahead) as soon as its readers are done with it, before the next tile is waited for: the
//           whole ring is in flight during the wait, kStages - 1 tiles while one is used. Who loads:
//           - column loads (kCtaLoads false): each key column of warps (same wn) loads its own
//             kKeysPerWarp rows of every tile and syncs only with itself (__syncwarp, or a named
//             barrier over its kWarpsM warps), no CTA barrier in the main loop: for the short splits
//             at 3 CTAs per SM;
//           - CTA loads (kCtaLoads, or kStages == 1 on small-smem GPUs): the 128 threads load each tile
//             together, 8 consecutive rows per pass, and sync with CTA barriers: faster for the long
//             splits the plan launches 2 per SM (cuflash/plan/decode.py decode_cta_loads).
//   Paged caches: key n of sequence b lives at page block_table[b][n / page_size], slot n % page_size;
//           contiguous caches at (b, n). Every page index is clamped into [0, num_pages), every
//           length into [0, capacity): whatever cache_seqlens and block_table hold, no access
//           leaves the cache (a bad value gives wrong numbers, never a wild read or write).
//
// Per thread (g = lane / 4, t = lane % 4) of warp (wm, wn), rows g and g + 8 of slab wm:
//   WarpTile::acc_o[0][d/8][...] unnormalized O, row_max m (raw score units), row_sum (quad part of l),
//   exactly as in the forward kernel: P = exp2(S * scale_log2 - m * scale_log2), O rescaled on a new max.
// Merge of the warp columns (per row):  m* = max_w m_w,  l* = sum_w l_w 2^{(m_w - m*) scale_log2},
//   O = sum_w O_w 2^{(m_w - m*) scale_log2} / l*,  lse = m* scale + ln l*.
//
// Variants (Cfg::kMods: window, softcap, ALiBi; DecodeRowMods): aligned to each sequence's end like
// causal; with a window the splits cover the tiles from the window's first key (decode_first_tile).
//
// Preconditions (checked in Python, cuflash/kvcache.py): head_dim <= kHeadDim; kAligned variants
// need 16-byte aligned rows of q, the caches and out (base % 16 == 0, strides % 8 elements,
// head_dim % 8 == 0); 1 <= num_splits <= kDecodeMaxSplits; page_size >= 1 (a multiple of 16 from Python);
// capacity + seqlen_new < 2^31; softmax_scale > 0.
#pragma once

#include "decode_common.cuh"
#include "decode_merge.cuh"
#include "masks.cuh"  // ScoreMods: window, softcap, ALiBi
#include "params.h"
#include "primitives.cuh"
#include "warp_tile.cuh"  // WarpTile: the per-warp S = Q K^T, online softmax and O += P V steps

namespace cuflash {

// Compile-time shape of one split-KV variant. Tile choices come from cuflash/plan/decode_kernels.py (DECODE_TILES).
template <int kHeadDim_, int kBlockN_, int kMSlabs_, int kStages_, bool kIsBF16_, bool kAligned_, bool kCtaLoads_,
          bool kTailGrid_ = false, int kMods_ = 0>
struct DecodeConfig {
    static constexpr int kHeadDim = kHeadDim_;   // head-dim bucket (multiple of 32)
    static constexpr int kBlockN = kBlockN_;     // keys per K/V tile
    static constexpr int kMSlabs = kMSlabs_;     // 16-row slabs of packed query rows per CTA
    static constexpr int kStages = kStages_;     // K/V tiles in the cp.async ring
    static constexpr bool kIsBF16 = kIsBF16_;
    static constexpr bool kAligned = kAligned_;  // 16-byte cp.async loads; else element-wise loads
    // The CTA loads every K/V tile together and syncs with CTA barriers (always with one stage); else
    // each key column of warps loads and syncs on its own rows (see Pipeline above).
    static constexpr bool kCtaLoads = kCtaLoads_ || kStages_ == 1;
    // The tail-split grid (see the header); a variant of its own, so the other grids' code is untouched.
    static constexpr bool kTailGrid = kTailGrid_;
    // Attention variants (masks.cuh kMod* bits): window, softcap, ALiBi (no dropout in decode).
    static constexpr int kMods = kMods_;
    static_assert((kMods & kModDropout) == 0, "decode has no dropout");

    static constexpr int kNWarps = kDecodeThreads / 32;
    static constexpr int kNThreads = kDecodeThreads;
    static constexpr int kWarpsM = kMSlabs;             // warp rows: one 16-row slab each
    static constexpr int kWarpsN = kNWarps / kMSlabs;   // warp columns: share each tile's keys
    static constexpr int kBlockM = 16 * kMSlabs;        // packed query rows per CTA
    static constexpr int kKeysPerWarp = kBlockN / kWarpsN;
    static constexpr int kSmemStride = kHeadDim + 8;    // elements per Q smem row (16 bytes pad)
    // K/V rows: unpadded and XOR-swizzled where the head dim is whole 128-byte groups, else padded
    // (warp_tile.cuh kv_chunk_offset; the swizzle is what lets the cp.async stream reach HBM speed).
    // Not at hd256 with more than one slab: the swizzle's per-lane offsets make those spill.
    static constexpr bool kKVSwizzled = kHeadDim % 64 == 0 && !(kHeadDim == 256 && kMSlabs > 1);
    static constexpr int kKVStride = kKVSwizzled ? kHeadDim : kSmemStride;
    static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per row
    static constexpr int kRedStride = kHeadDim + 8;     // floats per row of the merge buffer
    static constexpr int kSmemQBytes = 2 * kBlockM * kSmemStride;
    static constexpr int kSmemMLBytes = 2 * 4 * kWarpsN * kBlockM;           // m and l, fp32
    static constexpr int kSmemKV = kBlockN * kKVStride;                     // elements of one K (or V) tile
    static constexpr int kSmemPipeBytes = 2 * 2 * kStages * kSmemKV;         // kStages x (K, V)
    static constexpr int kSmemRedBytes = 4 * kWarpsN * kBlockM * kRedStride;  // merge buffer, fp32
    static constexpr int kSmemBytes =
        kSmemQBytes + kSmemMLBytes + (kSmemPipeBytes > kSmemRedBytes ? kSmemPipeBytes : kSmemRedBytes);

    static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head-dim buckets are multiples of 32");
    static_assert(kNWarps % kMSlabs == 0, "the warps split evenly into slab rows");
    static_assert(kBlockN % kWarpsN == 0 && kKeysPerWarp % 16 == 0, "every warp owns whole 16-key MMA k-steps");
    static_assert((kSmemStride / 8) % 2 == 1, "odd 16-byte row stride keeps ldmatrix conflict free");
    static_assert(kStages >= 1, "at least one K/V stage");
    static_assert((kSmemQBytes + kSmemMLBytes) % 128 == 0, "the K/V stages start 128-byte aligned (swizzle groups)");
    static_assert(kSmemMLBytes >= 4, "the merge of the splits reuses m for its flag (and the stages, DecodeMergeLayout)");
};

// The per-warp view that warp_tile.cuh's WarpTile expects: one 16-row slab, kKeysPerWarp keys.
template <class Cfg>
struct DecodeWarpConfig {
    static constexpr int kMSlabs = 1;
    static constexpr int kNBlocksS = Cfg::kKeysPerWarp / 8;  // 8-column MMA blocks of S
    static constexpr int kDBlocks = Cfg::kHeadDim / 8;       // 8-column MMA blocks of O
    static constexpr int kKStepsQK = Cfg::kHeadDim / 16;     // k-steps of S = Q K^T
    static constexpr int kKStepsPV = Cfg::kKeysPerWarp / 16; // k-steps of O += P V
    static constexpr int kSmemStride = Cfg::kSmemStride;
    static constexpr bool kKVSwizzled = Cfg::kKVSwizzled;
    static constexpr int kKVStride = Cfg::kKVStride;
    static constexpr bool kIsBF16 = Cfg::kIsBF16;
    static constexpr bool kQInRegs = false;  // Q is re-read from smem per tile (memory bound: free)
};

// Copy 8 (or, on the last chunk of a row, fewer) 2-byte elements into smem as one 16-byte store,
// zero-filling columns >= head_dim (element-wise path: rows not 16-byte aligned or odd head dims).
CUFLASH_DEVICE void decode_copy_chunk_scalar(u16* s_dst, const u16* g_src, bool row_ok, int col, int head_dim) {
    u32 packed[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
        const u32 lo = (row_ok && col + e < head_dim) ? g_src[e] : 0u;
        const u32 hi = (row_ok && col + e + 1 < head_dim) ? g_src[e + 1] : 0u;
        packed[e / 2] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(s_dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// sQ <- the CTA's kBlockM packed query rows (rows >= rows_valid and columns >= head_dim zero-filled).
template <class Cfg>
CUFLASH_DEVICE void decode_load_q(u16* s_q, const DecodeParams& p, int b, int hk, int row0, int rows_valid, int tid) {
    constexpr int kC = Cfg::kChunksPerRow;
    const u16* g_q = static_cast<const u16*>(p.q) + b * p.q_batch_stride;
    for (int chunk = tid; chunk < Cfg::kBlockM * kC; chunk += Cfg::kNThreads) {
        const int r = chunk / kC, col = (chunk % kC) * 8;
        const bool row_ok = r < rows_valid;
        int i = 0, h = 0;
        if (row_ok) decode_unpack_row(p, hk, row0 + r, i, h);
        const u16* g_src = g_q + i * p.q_row_stride + h * p.q_head_stride + col;
        u16* s_dst = s_q + r * Cfg::kSmemStride + col;
        if constexpr (Cfg::kAligned) {
            const bool valid = row_ok && col < p.head_dim;
            cp_async_16(smem_u32(s_dst), valid ? g_src : g_q, valid);
        } else {
            decode_copy_chunk_scalar(s_dst, g_src, row_ok, col, p.head_dim);
        }
    }
}

// The value of x, hidden from the optimizer: computations that depend on it cannot be hoisted out of
// the loop it sits in.
CUFLASH_DEVICE int decode_opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

// decode_load_kv's general path: every row located on its own (page lookup, bounds), once per
// thread and used for its K and its V chunk.
template <class Cfg, int kRows, int kThreads>
CUFLASH_DEVICE void decode_load_kv_rows(u16* s_k, u16* s_v, const u16* g_k, const u16* g_v, const DecodeParams& p,
                                        const DecodeCacheRows& cache, int n0, int L, int tid_, int row0) {
    const int tid = decode_opaque(tid_);
    constexpr int kC = Cfg::kChunksPerRow;
    constexpr int kChunks = kRows * kC;
    constexpr int kPasses = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
        const int chunk = tid + pass * kThreads;
        if (kChunks % kThreads != 0 && chunk >= kChunks) break;
        const int row = row0 + chunk / kC, col = (chunk % kC) * 8;
        const int n = n0 + row;
        const bool row_ok = n < L;
        int page = 0, slot = 0;
        if (row_ok) cache.locate(n, page, slot);
        const u16* src_k = g_k + page * p.k_batch_stride + slot * p.k_row_stride + col;
        const u16* src_v = g_v + page * p.v_batch_stride + slot * p.v_row_stride + col;
        const int s_off = kv_chunk_offset<Cfg::kKVSwizzled, Cfg::kKVStride>(row, col / 8);
        u16* dst_k = s_k + s_off;
        u16* dst_v = s_v + s_off;
        if constexpr (Cfg::kAligned) {
            // head_dim % 8 == 0 here, so a chunk is either wholly inside the row or wholly outside.
            const bool valid = row_ok && col < p.head_dim;
            cp_async_16(smem_u32(dst_k), valid ? src_k : g_k, valid);
            cp_async_16(smem_u32(dst_v), valid ? src_v : g_v, valid);
        } else {
            decode_copy_chunk_scalar(dst_k, src_k, row_ok, col, p.head_dim);
            decode_copy_chunk_scalar(dst_v, src_v, row_ok, col, p.head_dim);
        }
    }
}

// sK, sV <- tile rows [row0, row0 + kRows) = keys [n0 + row0, n0 + row0 + kRows) of the sequence (rows
// >= L and columns >= head_dim zero-filled, so masked keys contribute exactly 0 to P V), by kThreads
// threads (tid < kThreads). Chunk c of those rows goes to thread c % kThreads: 16 consecutive threads
// cover one 256-byte row at head dim 128 (coalesced). The thread index is made opaque so the per-pass
// addresses are recomputed for every tile instead of being held in registers across the main loop
// (they would crowd out the O accumulator at large head dims).
// Where all kRows rows are keys of the sequence and lie in one cache row or page (in a contiguous
// cache every tile but a ragged last one; in a paged one every 16-row column share, page sizes being
// multiples of 16, and the longer shares and CTA tiles that do not cross a page boundary), the rows
// are found once per call and each pass only steps a pointer; else every row is located on its own
// (decode_load_kv_rows). Same addresses either way: the fast path only issues fewer instructions,
// which the main loop feels where few warps share an SM (a lone CTA per SM streamed ~1.3 us per
// 64-key tile, most of its ~1000 instructions per tile being this address arithmetic).
template <class Cfg, int kRows = Cfg::kBlockN, int kThreads = Cfg::kNThreads>
CUFLASH_DEVICE void decode_load_kv(u16* s_k, u16* s_v, const u16* g_k, const u16* g_v, const DecodeParams& p,
                                   const DecodeCacheRows& cache, int n0, int L, int tid_, int row0 = 0) {
    constexpr int kC = Cfg::kChunksPerRow;
    constexpr int kChunks = kRows * kC;
    constexpr int kPasses = (kChunks + kThreads - 1) / kThreads;
    // One slab only: with two (hd128, 3 CTAs per SM) the fast path cost a spill under NVRTC 12.9, and
    // the 2- and 4-slab variants are not measured with it.
    if constexpr (Cfg::kAligned && Cfg::kMSlabs == 1 && kThreads % kC == 0 && kRows % (kThreads / kC) == 0) {
        const int first = n0 + row0;  // the first key of these rows
        if (L - first >= kRows) {  // (first + kRows could overflow next to 2^31)
            int page = cache.b, slot = first, in_page = kRows;
            if (cache.bt_row != nullptr) {
                const int blk = first / cache.page_size;
                page = min(max(cache.bt_row[blk], 0), cache.num_pages - 1);
                slot = first - blk * cache.page_size;
                in_page = cache.page_size - slot;
            }
            if (in_page >= kRows) {
                // Thread tid takes column chunk tid % kC of rows tid / kC + pass * kRowsPerPass: one
                // pointer per tensor, stepped by kRowsPerPass rows a pass (a chunk past head_dim copies
                // nothing, from the first element of the kv head's cache, with no step).
                constexpr int kRowsPerPass = kThreads / kC;
                const int tid = decode_opaque(tid_);
                const int r = tid / kC, c = tid % kC;
                const bool valid = c * 8 < p.head_dim;
                const u16* src_k = g_k;
                const u16* src_v = g_v;
                long long step_k = 0, step_v = 0;
                if (valid) {
                    src_k += page * p.k_batch_stride + (slot + r) * p.k_row_stride + c * 8;
                    src_v += page * p.v_batch_stride + (slot + r) * p.v_row_stride + c * 8;
                    step_k = kRowsPerPass * p.k_row_stride;
                    step_v = kRowsPerPass * p.v_row_stride;
                }
#pragma unroll
                for (int pass = 0; pass < kPasses; ++pass) {
                    const int s_off = kv_chunk_offset<Cfg::kKVSwizzled, Cfg::kKVStride>(row0 + r + pass * kRowsPerPass, c);
                    cp_async_16(smem_u32(s_k + s_off), src_k, valid);
                    cp_async_16(smem_u32(s_v + s_off), src_v, valid);
                    src_k += step_k;
                    src_v += step_v;
                }
                return;
            }
        }
    }
    decode_load_kv_rows<Cfg, kRows, kThreads>(s_k, s_v, g_k, g_v, p, cache, n0, L, tid_, row0);
}

// S[0][nb][2h + e] is row g + 8h of the warp's slab, key col0 + 8 nb + e (col0 = first key + 2t):
// keys >= the row's limit get -inf (ragged end of the sequence, causal diagonal).
template <int kNB>
CUFLASH_DEVICE void decode_mask(float (&S)[1][kNB][4], int col0, const int (&limit)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (col0 + 8 * nb + e >= limit[h]) S[0][nb][2 * h + e] = -kInf;
}

// The first K/V tile any query of sequence b (L keys) sees: with a window, the one holding key
// max(L - seqlen_q - window_left, cache_leftpad[b]) (token 0's first), so the splits cover only the
// window; else 0.
template <class Cfg>
CUFLASH_DEVICE int decode_first_tile(const DecodeParams& p, int b, int L) {
    if constexpr ((Cfg::kMods & kModWindow) != 0) {
        return max(decode_first_key(p, b, L), L - p.seqlen_q - p.mod.window_left) / Cfg::kBlockN;
    } else {
        return 0;
    }
}

// The variants on a decode warp's scores (masks.cuh ScoreMods): rows g and g + 8 of its slab (packed
// rows r0 and r0 + 8: token i = r / group, query head hk * group + r % group), keys of the sequence's L.
// Softcap and ALiBi on every score, then the mask: keys >= limit (the ragged end, causal, the window's
// right edge) and, with a window, keys < first (its left edge).
template <class Cfg>
struct DecodeRowMods {
    using Mods = ScoreMods<Cfg::kMods>;
    Mods mods;
    int diag[2], first[2];  // per row: the key the query is aligned to (L - seqlen_q + i), its first key
    float slope[2];
    int first_hi;           // the largest first key of the CTA's rows ... of this warp's rows

    CUFLASH_DEVICE DecodeRowMods(const DecodeParams& p, int b, int hk, int r0, int L, int (&limit)[2]) : mods(p.mod) {
        first_hi = 0;
        const int lo = Mods::kWindow ? decode_first_key(p, b, L) : 0;  // cache_leftpad: keys before it are padding
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = min(r0 + 8 * h, p.rows - 1);  // padding rows copy the last real row
            const int i = r / p.group;
            diag[h] = L - p.seqlen_q + i;
            slope[h] = Mods::alibi_slope(p.mod, b, hk * p.group + (r - i * p.group));
            first[h] = max(mods.first_key(diag[h]), lo);
            if constexpr (Mods::kWindow) limit[h] = min(limit[h], max(0, diag[h] + mods.window_right + 1));
        }
        first_hi = max(first[0], first[1]);
    }

    // S[0][nb][2h + e] is row g + 8h, key n0 + 2t + 8 nb + e of the warp's share of kKeys keys.
    template <int kNB>
    CUFLASH_DEVICE void apply(float (&S)[1][kNB][4], int n0, int t, int limit_lo, int keys, const int (&limit)[2]) const {
        if constexpr (Mods::kModifiesScores) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float dist0 = static_cast<float>(diag[h] - (n0 + 2 * t));
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        S[0][nb][2 * h + e] = mods.modify(S[0][nb][2 * h + e], dist0 - (8 * nb + e), slope[h]);
            }
        }
        // (limit_lo is the smallest limit of the CTA's rows; with a window the rows' own limits are smaller.)
        if (n0 + keys > (Mods::kWindow ? min(limit_lo, min(limit[0], limit[1])) : limit_lo) || (Mods::kWindow && n0 < first_hi)) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int j = n0 + 2 * t + 8 * nb + e;
                        if (j >= limit[h] || (Mods::kWindow && j < first[h])) S[0][nb][2 * h + e] = -kInf;
                    }
        }
    }
};

// Plain variants carry no per-row variant state.
struct DecodeNoRowMods {
    CUFLASH_DEVICE DecodeNoRowMods(const DecodeParams&, int, int, int, int, int (&)[2]) {}
};
template <class Cfg>
using DecodeRowModsOf = Choose<Cfg::kMods != 0, DecodeRowMods<Cfg>, DecodeNoRowMods>;

// One split CTA: tiles [tile_begin, tile_end) of the L keys of (sequence b, kv head hk), packed query
// rows of row block rb, as split `split` of the group's n_splits. One split: O and lse written
// directly; several: this split's partial rows, then the merge by the last split CTA of the group to
// finish (or, without counters, the combine kernel). tile_begin >= tile_end (an empty split) writes
// lse = -inf and O = 0.
template <class Cfg>
CUFLASH_DEVICE void decode_split(const DecodeParams& p, int b, int hk, int rb, int split, int L, int tile_begin,
                                 int tile_end, int n_splits) {
    using WCfg = DecodeWarpConfig<Cfg>;
    constexpr int kBlockN = Cfg::kBlockN, kBlockM = Cfg::kBlockM;
    constexpr int kNB = WCfg::kNBlocksS, kDB = WCfg::kDBlocks, kRed = Cfg::kRedStride;
    constexpr bool kBF16 = Cfg::kIsBF16;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int wm = warp / Cfg::kWarpsN, wn = warp % Cfg::kWarpsN;
    const int row0 = rb * kBlockM;  // first packed row of this CTA
    const int rows_valid = min(kBlockM, p.rows - row0);
    const bool final_out = n_splits == 1;  // write O and lse directly, no merge of splits

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* s_q = reinterpret_cast<u16*>(smem_raw);
    float* s_m = reinterpret_cast<float*>(smem_raw + Cfg::kSmemQBytes);  // [kWarpsN][kBlockM]: m of each warp column
    float* s_l = s_m + Cfg::kWarpsN * kBlockM;                           // [kWarpsN][kBlockM]: l of each warp column
    unsigned char* s_pipe = smem_raw + Cfg::kSmemQBytes + Cfg::kSmemMLBytes;
    u16* s_k0 = reinterpret_cast<u16*>(s_pipe);     // K stage s at s_k0 + s * kSmemKV
    u16* s_v0 = s_k0 + Cfg::kStages * Cfg::kSmemKV;  // V stage s at s_v0 + s * kSmemKV
    float* s_red = reinterpret_cast<float*>(s_pipe);  // epilogue only: [kWarpsN][kBlockM][kRed], over the stages

    if (tile_begin >= tile_end) {  // no key in this split: O = 0, lse = -inf (final or partial rows)
        for (int r = tid; r < rows_valid; r += Cfg::kNThreads) {
            int i, h;
            decode_unpack_row(p, hk, row0 + r, i, h);
            if (!final_out) p.lse_partial[decode_row_index(p, split, b, h, i)] = -kInf;
            else if (p.lse != nullptr) p.lse[decode_row_index(p, 0, b, h, i)] = -kInf;
        }
        const int width = final_out ? p.head_dim : p.partial_stride;  // partial rows: the whole bucket
        for (int e = tid; e < rows_valid * width; e += Cfg::kNThreads) {
            int i, h;
            decode_unpack_row(p, hk, row0 + e / width, i, h);
            if (final_out) {
                static_cast<u16*>(p.o)[b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride + e % width] = 0;
            } else {
                p.o_partial[decode_row_index(p, split, b, h, i) * p.partial_stride + e % width] = 0.f;
            }
        }
    } else {  // this split's tiles
        const u16* g_k = static_cast<const u16*>(p.k) + hk * p.k_head_stride;
        const u16* g_v = static_cast<const u16*>(p.v) + hk * p.v_head_stride;
        const DecodeCacheRows cache = decode_cache_rows(p, b);
        // Column loads: each key column of warps (the kWarpsM warps with the same wn) loads and syncs on
        // its own rows of every tile, the kKeysPerWarp keys it alone reads: no CTA-wide barrier in the
        // main loop, so a column whose rows have landed goes on while another waits. CTA loads: the CTA
        // loads and syncs on the whole tile.
        constexpr int kColThreads = 32 * Cfg::kWarpsM;
        const int col_tid = wm * 32 + lane;  // thread index within the key column
        // Tile `tile` into stage `stage` (nothing past this split's last tile); always one commit group
        // per call, so the group count stays in step with the tiles.
        auto issue = [&](int tile, int stage) {
            if (tile < tile_end) {
                if constexpr (!Cfg::kCtaLoads) {
                    decode_load_kv<Cfg, Cfg::kKeysPerWarp, kColThreads>(
                        s_k0 + stage * Cfg::kSmemKV, s_v0 + stage * Cfg::kSmemKV, g_k, g_v, p, cache, tile * kBlockN,
                        L, col_tid, wn * Cfg::kKeysPerWarp);
                } else {
                    decode_load_kv<Cfg>(s_k0 + stage * Cfg::kSmemKV, s_v0 + stage * Cfg::kSmemKV, g_k, g_v, p, cache,
                                        tile * kBlockN, L, tid);
                }
            }
            cp_async_commit();
        };
        // The warps that load and read the same rows (the key column, or with CTA loads the CTA): after
        // it, a tile's rows are visible to them all, and all are done with the rows before.
        auto loader_sync = [&]() {
            if constexpr (Cfg::kCtaLoads) {
                __syncthreads();
            } else if constexpr (Cfg::kWarpsM == 1) {
                __syncwarp();
            } else {
                asm volatile("bar.sync %0, %1;" ::"r"(1 + wn), "r"(kColThreads) : "memory");
            }
        };

        // Prologue: Q joins the first tile's group; the first kStages tiles fill the ring.
        decode_load_q<Cfg>(s_q, p, b, hk, row0, rows_valid, tid);
    #pragma unroll
        for (int s = 0; s < Cfg::kStages; ++s) issue(tile_begin + s, s);

        WarpTile<WCfg> wt;
        wt.init(16 * wm, lane);
        const float scale_log2 = p.scale_log2;
        // Causal: packed row r (token i = r / group) sees keys < L - seqlen_q + 1 + i; padding rows
        // (r >= rows) get L, they are never written. limit_lo: the smallest limit of the CTA's rows.
        int limit[2];
    #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int i = (row0 + 16 * wm + 8 * h + g) / p.group;
            limit[h] = p.is_causal ? min(L, L - p.seqlen_q + 1 + i) : L;
        }
        const int limit_lo = p.is_causal ? L - p.seqlen_q + 1 + row0 / p.group : L;
        DecodeRowModsOf<Cfg> row_mods(p, b, hk, row0 + 16 * wm + g, L, limit);  // the variants' per-row values
        const bool warp_has_rows = 16 * wm < rows_valid;  // else the slab is padding: skip its MMAs
        float S[1][kNB][4];  // scores, then probabilities, of the warp's keys of the current tile

        int stage = 0;  // stage holding `tile`: tile_begin + k lives in stage k % kStages
        for (int tile = tile_begin; tile < tile_end; ++tile) {
            if (tile > tile_begin) {
                // The warps reading the previous tile's rows are done with them: its stage, (stage - 1)
                // mod kStages, takes tile + kStages - 1 before this tile is waited for, so the whole
                // ring (kStages tiles) is in flight during the wait, not kStages - 1.
                loader_sync();
                issue(tile + Cfg::kStages - 1, stage == 0 ? Cfg::kStages - 1 : stage - 1);
            }
            cp_async_wait<Cfg::kStages - 1>();  // this tile's group (and, first, Q's) landed for this thread
            // ... and for the warps that read it (Q: every warp).
            if (tile == tile_begin) {
                __syncthreads();
            } else {
                loader_sync();
            }
            const int n0 = tile * kBlockN + wn * Cfg::kKeysPerWarp;  // first key of this warp's share
            if (warp_has_rows && n0 < L) {  // warp-uniform: a share wholly past the end is all masked
                const u16* s_k = s_k0 + stage * Cfg::kSmemKV + wn * Cfg::kKeysPerWarp * Cfg::kKVStride;
                const u16* s_v = s_v0 + stage * Cfg::kSmemKV + wn * Cfg::kKeysPerWarp * Cfg::kKVStride;
                // S = Q K^T                      S[r][c] = sum_d Q[r][d] K[c][d]
                wt.gemm_qk(S, s_q, s_k);
                if constexpr (Cfg::kMods != 0) {
                    row_mods.apply(S, n0, t, limit_lo, Cfg::kKeysPerWarp, limit);
                } else {
                    if (n0 + Cfg::kKeysPerWarp > limit_lo) decode_mask(S, n0 + 2 * t, limit);
                }
                wt.softmax(S, scale_log2);
                // O += P V                       O[r][d] += sum_c P[r][c] V[c][d]
                wt.gemm_pv(S, s_v);
            }
            stage = stage + 1 == Cfg::kStages ? 0 : stage + 1;
        }

        // Epilogue 1: m and l of every warp column. The merge buffer overwrites the K/V stages: wait for
        // this thread's copies (only empty groups remain) and for every warp to finish its last tile.
        cp_async_wait<0>();
        __syncthreads();  // all warps done reading sK / sV; no cp.async into them in flight
        float l_own[2];
    #pragma unroll
        for (int h = 0; h < 2; ++h) {
            l_own[h] = quad_sum(wt.row_sum[0][h]);
            if (t == 0) {
                s_m[wn * kBlockM + 16 * wm + 8 * h + g] = wt.row_max[0][h];
                s_l[wn * kBlockM + 16 * wm + 8 * h + g] = l_own[h];
            }
        }
        __syncthreads();  // every warp column's m and l visible

        // Epilogue 2: m* = max_w m_w, l* = sum_w l_w 2^{(m_w - m*) scale_log2}; this warp's O scaled by
        // 2^{(m_own - m*) scale_log2} / l* into its rows of the merge buffer. Rows that saw no key in any
        // warp (m* = -inf) get l* = 0, factor 0, O = 0 and lse = -inf.
        float factor[2];
    #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = 16 * wm + 8 * h + g;
            float m_all = -kInf;
    #pragma unroll
            for (int w = 0; w < Cfg::kWarpsN; ++w) m_all = fmaxf(m_all, s_m[w * kBlockM + r]);
            const float m_scaled = m_all == -kInf ? 0.f : m_all * scale_log2;  // -inf - (-inf) would be NaN
            float l_all = 0.f;
    #pragma unroll
            for (int w = 0; w < Cfg::kWarpsN; ++w) l_all += s_l[w * kBlockM + r] * fast_exp2(fmaf(s_m[w * kBlockM + r], scale_log2, -m_scaled));
            const float inv_l = l_all > 0.f ? 1.f / l_all : 0.f;
            factor[h] = fast_exp2(fmaf(wt.row_max[0][h], scale_log2, -m_scaled)) * inv_l;
            if (wn == 0 && t == 0 && r < rows_valid) {
                int i, hq;
                decode_unpack_row(p, hk, row0 + r, i, hq);
                const float lse = l_all > 0.f ? m_all * p.softmax_scale + __logf(l_all) : -kInf;
                if (!final_out) p.lse_partial[decode_row_index(p, split, b, hq, i)] = lse;
                else if (p.lse != nullptr) p.lse[decode_row_index(p, 0, b, hq, i)] = lse;
            }
        }
        float* s_red_w = s_red + (wn * kBlockM + 16 * wm) * kRed;
    #pragma unroll
        for (int h = 0; h < 2; ++h)
    #pragma unroll
            for (int d = 0; d < kDB; ++d)
                *reinterpret_cast<float2*>(s_red_w + (8 * h + g) * kRed + d * 8 + 2 * t) =
                    make_float2(wt.acc_o[0][d][2 * h] * factor[h], wt.acc_o[0][d][2 * h + 1] * factor[h]);
        __syncthreads();  // every warp column's scaled O rows in the merge buffer

        // Epilogue 3: O[r][c..c+7] = sum_w merge[w][r][c..c+7], written as the final output (dtype, 16-byte
        // stores on the aligned path) or as this split's fp32 partial row.
        constexpr int kC = Cfg::kChunksPerRow;
        for (int unit = tid; unit < kBlockM * kC; unit += Cfg::kNThreads) {
            const int r = unit / kC, col = (unit % kC) * 8;
            if (r >= rows_valid) continue;
            float o[8];
    #pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = 0.f;
    #pragma unroll
            for (int w = 0; w < Cfg::kWarpsN; ++w) {
                const float* src = s_red + (w * kBlockM + r) * kRed + col;
                const float4 x0 = *reinterpret_cast<const float4*>(src);
                const float4 x1 = *reinterpret_cast<const float4*>(src + 4);
                o[0] += x0.x; o[1] += x0.y; o[2] += x0.z; o[3] += x0.w;
                o[4] += x1.x; o[5] += x1.y; o[6] += x1.z; o[7] += x1.w;
            }
            int i, h;
            decode_unpack_row(p, hk, row0 + r, i, h);
            if (final_out) {
                u16* g_o = static_cast<u16*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride + col;
                u32 packed[4];
    #pragma unroll
                for (int e = 0; e < 4; ++e) packed[e] = pack2<kBF16>(o[2 * e], o[2 * e + 1]);
                if constexpr (Cfg::kAligned) {
                    if (col < p.head_dim) *reinterpret_cast<uint4*>(g_o) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
                } else {
    #pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        if (col + e < p.head_dim) g_o[e] = static_cast<u16>(packed[e / 2] >> (16 * (e % 2)));
                    }
                }
            } else {
                // The whole bucket row is written (columns >= head_dim hold 0): combine reads float4s.
                float* g_op = p.o_partial + decode_row_index(p, split, b, h, i) * p.partial_stride + col;
                *reinterpret_cast<float4*>(g_op) = make_float4(o[0], o[1], o[2], o[3]);
                *reinterpret_cast<float4*>(g_op + 4) = make_float4(o[4], o[5], o[6], o[7]);
            }
        }
    }
    // Several splits: the last CTA of the group merges them, in the stages and with m as its flag
    // (one call site per kernel variant: the merge is large code), unless the combine kernel does (no
    // counters).
    if (!final_out && p.split_counters != nullptr) {
        decode_merge_if_last<Cfg>(p, b, hk, rb, row0, rows_valid, n_splits, reinterpret_cast<float*>(s_pipe),
                                  reinterpret_cast<int*>(s_m), tid);
    }
}

template <class Cfg>
CUFLASH_DEVICE void flash_decode_kernel(const DecodeParams& p) {
    // Launched with programmatic dependent launch (sm_90+): the kernel before (the append, or the
    // previous call's kernels) has finished before anything here touches global memory; the kernel
    // after (the combine, or the next call's) may start its CTAs as slots free up.
    grid_dependency_wait();
    grid_launch_dependents();
    // Split grids: CTA (x, hk, b) takes split x / num_row_blocks of the keys of (b, hk), row block x %
    // num_row_blocks; split_major grids are (hk, b, x), so the block scheduler starts the CTAs of
    // the last split (a short tail, see split_tiles) last. Tail-split grids (kTailGrid): below.
    if constexpr (Cfg::kTailGrid) {
        // Tail-split grid, 1-D (see the header; its plans have one slab and one row block): CTA c < G0
        // takes group c whole, CTA G0 + k split k / tail_groups of group G0 + k % tail_groups.
        static_assert(Cfg::kMSlabs == 1, "the tail-split grid runs one slab per CTA");
        const int c = blockIdx.x, g0 = p.batch * p.nheads_kv - p.tail_groups;
        const bool whole = c < g0;
        const int split = whole ? 0 : (c - g0) / p.tail_groups;
        const int group = whole ? c : g0 + (c - g0) % p.tail_groups;
        const int n_splits = whole ? 1 : p.num_splits;
        const int hk = group % p.nheads_kv, b = group / p.nheads_kv;
        const int L = min(decode_cached_len(p, b) + p.seqlen_new, p.capacity);  // keys after the append
        const int tile_lo = decode_first_tile<Cfg>(p, b, L);
        const int n_tiles = ceil_div_nonneg(L, Cfg::kBlockN) - tile_lo;
        const int tiles_per_split = ceil_div_nonneg(n_tiles, n_splits);
        const int tile_begin = split * tiles_per_split;
        const int tile_end = min(tile_begin + tiles_per_split, n_tiles);
        decode_split<Cfg>(p, b, hk, 0, split, L, tile_lo + tile_begin, tile_lo + tile_end, n_splits);
    } else {
        const int x = p.split_major ? blockIdx.z : blockIdx.x;
        const int split = x / p.num_row_blocks, rb = x % p.num_row_blocks;
        const int hk = p.split_major ? blockIdx.x : blockIdx.y, b = p.split_major ? blockIdx.y : blockIdx.z;
        const int L = min(decode_cached_len(p, b) + p.seqlen_new, p.capacity);  // keys after the append
        const int tile_lo = decode_first_tile<Cfg>(p, b, L);
        const int n_tiles = ceil_div_nonneg(L, Cfg::kBlockN) - tile_lo;
        const int tiles_per_split = p.split_tiles > 0 ? p.split_tiles : ceil_div_nonneg(n_tiles, p.num_splits);
        const int tile_begin = split * tiles_per_split;
        const int tile_end = min(tile_begin + tiles_per_split, n_tiles);
        decode_split<Cfg>(p, b, hk, rb, split, L, tile_lo + tile_begin, tile_lo + tile_end, p.num_splits);
    }
}
}  // namespace cuflash
