// Decode with a KV cache: what every decode kernel shares (the split kernel, the merge of the splits,
// the combine and the append kernels; flash_decode.cuh describes the whole operation).
//
// Sequences and caches: sequence b holds L_b = min(clamp(cache_seqlens[b], 0, capacity) + seqlen_new,
// capacity) keys; key n lives at (page, slot) = (b, n) in a contiguous cache, or at
// (block_table[b][n / page_size], n % page_size) in a paged one, every page index clamped into
// [0, num_pages). Packed query rows: the group * seqlen_q query rows that read kv head hk, row
// r = i * group + j for token i and query head hk * group + j.
#pragma once

#include "params.h"
#include "primitives.cuh"

namespace cuflash {

constexpr int kDecodeThreads = 128;   // every decode kernel runs 4 warps (cuflash/plan/decode_kernels.py: DECODE_THREADS)
constexpr int kDecodeMaxSplits = 128;  // cuflash/plan/decode_kernels.py: MAX_DECODE_SPLITS

CUFLASH_DEVICE float decode_warp_max(float x) {
#pragma unroll
    for (int m = 16; m > 0; m /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
    return x;
}
CUFLASH_DEVICE float decode_warp_sum(float x) {
#pragma unroll
    for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// Tokens already in the cache of sequence b, clamped into [0, capacity]; the append kernel and the
// attention kernel clamp alike, so they agree on where the new tokens went.
CUFLASH_DEVICE int decode_cached_len(const DecodeParams& p, int b) {
    const int s = p.seqlens != nullptr ? p.seqlens[b] : p.seqlen_const;
    return min(max(s, 0), p.capacity);
}

// Where token n of one sequence lives in the cache: (page, slot), the element offsets of the cache's
// dims 0 and 1. Contiguous: (b, n). Paged: (block_table[b][n / page_size] clamped into [0, num_pages),
// n % page_size). Callers only ask for n < L_b <= capacity = max_blocks * page_size.
struct DecodeCacheRows {
    const int* bt_row;  // block_table row of the sequence, or null for a contiguous cache
    int b, page_size, num_pages;

    CUFLASH_DEVICE void locate(int n, int& page, int& slot) const {
        if (bt_row != nullptr) {
            const int blk = n / page_size;
            page = min(max(bt_row[blk], 0), num_pages - 1);
            slot = n - blk * page_size;
        } else {
            page = b;
            slot = n;
        }
    }
};

// (A contiguous cache's row: b, or cache_batch_idx[b] clamped into [0, num_pages), num_pages being the
// cache's rows then.)
CUFLASH_DEVICE DecodeCacheRows decode_cache_rows(const DecodeParams& p, int b) {
    const int* bt_row = p.block_table != nullptr ? p.block_table + b * p.block_table_batch_stride : nullptr;
    const int row = p.cache_batch_idx != nullptr ? min(max(p.cache_batch_idx[b], 0), p.num_pages - 1) : b;
    return DecodeCacheRows{bt_row, row, p.page_size, p.num_pages};
}

// The first key of sequence b (cache_leftpad[b] clamped into [0, L]; 0 without left padding).
CUFLASH_DEVICE int decode_first_key(const DecodeParams& p, int b, int L) {
    return p.cache_leftpad != nullptr ? min(max(p.cache_leftpad[b], 0), L) : 0;
}

// Packed query row r of kv head hk -> query token i and query head h.
CUFLASH_DEVICE void decode_unpack_row(const DecodeParams& p, int hk, int r, int& i, int& h) {
    i = r / p.group;
    h = hk * p.group + (r - i * p.group);
}

// Index of (split, b, h, i) in lse_partial, of (b, h, i) in lse (split 0): (split, batch, nheads, seqlen_q).
CUFLASH_DEVICE i64 decode_row_index(const DecodeParams& p, int split, int b, int h, int i) {
    return (((i64)split * p.batch + b) * p.nheads + h) * p.seqlen_q + i;
}

}  // namespace cuflash
