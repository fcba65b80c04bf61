// Parameter block of the forward kernel family, passed by value as the kernel's only argument.
//
// Plain C on purpose: tests/test_params_layout.py compiles this header with the host C compiler and
// checks that every offset matches the NumPy structured dtype in cuflash/params.py that fills it.
// Only 8-byte fields first, then 4-byte fields, so host and device agree without any packing rule.
//
// Units: pointers are device addresses; every stride is in ELEMENTS (not bytes) of the tensor's
// dtype; the last (head) dimension is contiguous. Layout is flash-attn's (batch, seqlen, nheads, d).
#pragma once

#ifdef __cplusplus
namespace cuflash {
#endif

struct FwdParams {
    const void* q;             // (batch, seqlen_q, nheads, head_dim)
    const void* k;             // (batch, seqlen_k, nheads_kv, head_dim)
    const void* v;             // (batch, seqlen_k, nheads_kv, head_dim)
    void* o;                   // (batch, seqlen_q, nheads, head_dim), same dtype as q
    float* lse;                // (batch, nheads, seqlen_q) float32, contiguous; natural log
    long long q_batch_stride;  // elements between batch b and b+1 of q
    long long q_row_stride;    // elements between sequence positions i and i+1 of q
    long long q_head_stride;   // elements between heads h and h+1 of q
    long long k_batch_stride;
    long long k_row_stride;
    long long k_head_stride;
    long long v_batch_stride;
    long long v_row_stride;
    long long v_head_stride;
    long long o_batch_stride;
    long long o_row_stride;
    long long o_head_stride;
    int batch;
    int nheads;                // query heads
    int nheads_kv;             // key/value heads; nheads % nheads_kv == 0
    int head_ratio;            // nheads / nheads_kv: query head h reads kv head h / head_ratio
    int seqlen_q;
    int seqlen_k;
    int head_dim;              // real head dim (1..256); the kernel's bucket kHeadDim >= head_dim
    int num_m_blocks;          // ceil(seqlen_q / kBlockM) == gridDim.x
    float softmax_scale;       // multiplies q.k before the softmax (> 0)
    float scale_log2;          // softmax_scale * log2(e): the kernel exponentiates with exp2
};

#ifdef __cplusplus
}  // namespace cuflash
#endif
