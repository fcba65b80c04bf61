// Rotary position embedding (RoPE) of a decode call's query tokens or new key tokens, into a
// contiguous copy that the append and decode kernels then read (flash-attn's rotary_cos / rotary_sin
// of flash_attn_with_kvcache).
//
// For token t of sequence b (RotaryParams: pos = base_b + (per_token ? t : 0), base_b = the sequence's
// cached tokens minus its left padding, clamped into the rows of cos / sin), channel pairs (a, b) of
// angle i become (a cos_i - b sin_i, a sin_i + b cos_i):
//   kInterleaved = false (GPT-NeoX): pairs (i, i + rotary_dim / 2), i < rotary_dim / 2;
//   kInterleaved = true (GPT-J):     pairs (2i, 2i + 1);
// channels from rotary_dim on are copied. The math runs in fp32 on the values and cos / sin as stored.
// One thread per output element (a decode call rotates a few rows: the kernel is a few microseconds),
// grid-stride; blockDim = 256.
#pragma once

#include "params.h"
#include "primitives.cuh"

namespace cuflash {

template <bool kIsBF16, bool kInterleaved>
CUFLASH_DEVICE void rotary_kernel(const RotaryParams& p) {
    const i64 total = (i64)p.batch * p.seqlen * p.nheads * p.head_dim;
    const int half = p.rotary_dim / 2;
    for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const int c = static_cast<int>(idx % p.head_dim);
        i64 rest = idx / p.head_dim;
        const int h = static_cast<int>(rest % p.nheads);
        rest /= p.nheads;
        const int t = static_cast<int>(rest % p.seqlen);
        const int b = static_cast<int>(rest / p.seqlen);
        const u16* row = static_cast<const u16*>(p.x) + b * p.x_batch_stride + t * p.x_row_stride + h * p.x_head_stride;
        u16 result = row[c];
        if (c < p.rotary_dim) {
            const int cached = min(max(p.seqlens != nullptr ? p.seqlens[b] : p.seqlen_const, 0), p.capacity);
            const int pad = p.leftpad != nullptr ? p.leftpad[b] : 0;
            const int pos = min(max(cached - pad + (p.per_token ? t : 0), 0), p.seqlen_ro - 1);
            // This channel's angle and partner, and which side of the pair it is.
            const int angle = kInterleaved ? c / 2 : (c < half ? c : c - half);
            const bool first = kInterleaved ? (c % 2 == 0) : (c < half);
            const int partner = kInterleaved ? (c ^ 1) : (first ? c + half : c - half);
            const float cs = to_float<kIsBF16>(static_cast<const u16*>(p.cos)[pos * p.cos_row_stride + angle]);
            const float sn = to_float<kIsBF16>(static_cast<const u16*>(p.sin)[pos * p.sin_row_stride + angle]);
            const float x = to_float<kIsBF16>(row[c]), y = to_float<kIsBF16>(row[partner]);
            const float r = first ? fmaf(x, cs, -y * sn) : fmaf(y, sn, x * cs);
            result = static_cast<u16>(pack2<kIsBF16>(r, 0.f) & 0xffffu);
        }
        static_cast<u16*>(p.out)[idx] = result;
    }
}

}  // namespace cuflash
