// Decode with a KV cache: the in-place append of new tokens into the cache, launched before the split
// kernel when new k, v tokens are given (flash_decode.cuh describes the operation).
#pragma once

#include "decode_common.cuh"

namespace cuflash {

// Append: k_new[b, t] -> cache position clamp(cache_seqlens[b], 0, capacity) + t of sequence b, and
// the same for v; positions at or past capacity are dropped (Python rejects them where it can see
// the lengths). One thread per 16-byte chunk (kAligned) or element of a new row, grid-stride.
template <bool kAligned>
CUFLASH_DEVICE void flash_decode_append_kernel(const DecodeParams& p) {
    grid_dependency_wait();  // the kernel before on the stream (e.g. the previous call's) has finished
    grid_launch_dependents();
    constexpr int kElems = kAligned ? 8 : 1;
    const int chunks = (p.head_dim + kElems - 1) / kElems;
    const i64 total = (i64)p.batch * p.seqlen_new * p.nheads_kv * chunks;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const int c = static_cast<int>(idx % chunks);
        i64 rest = idx / chunks;
        const int hk = static_cast<int>(rest % p.nheads_kv);
        rest /= p.nheads_kv;
        const int tn = static_cast<int>(rest % p.seqlen_new);
        const int b = static_cast<int>(rest / p.seqlen_new);
        const int pos = decode_cached_len(p, b) + tn;
        if (pos >= p.capacity) continue;
        int page, slot;
        decode_cache_rows(p, b).locate(pos, page, slot);
        const int col = c * kElems;
        u16* dst_k = static_cast<u16*>(p.k) + page * p.k_batch_stride + slot * p.k_row_stride + hk * p.k_head_stride + col;
        u16* dst_v = static_cast<u16*>(p.v) + page * p.v_batch_stride + slot * p.v_row_stride + hk * p.v_head_stride + col;
        const u16* src_k = static_cast<const u16*>(p.k_new) + b * p.k_new_batch_stride + tn * p.k_new_row_stride +
                           hk * p.k_new_head_stride + col;
        const u16* src_v = static_cast<const u16*>(p.v_new) + b * p.v_new_batch_stride + tn * p.v_new_row_stride +
                           hk * p.v_new_head_stride + col;
        if constexpr (kAligned) {
            *reinterpret_cast<uint4*>(dst_k) = *reinterpret_cast<const uint4*>(src_k);
            *reinterpret_cast<uint4*>(dst_v) = *reinterpret_cast<const uint4*>(src_v);
        } else {
            *dst_k = *src_k;
            *dst_v = *src_v;
        }
    }
}


}  // namespace cuflash
