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

// The attention variants' runtime values (cuda_src/masks.cuh and varlen.cuh read them), the last field
// of every parameter block below. Which variants a kernel applies is a compile-time choice (its kMods bits);
// a field of a variant that is off is not read.
struct ModParams {
    const float* alibi_slopes;       // ALiBi: (batch, nheads) or (nheads,) float32 slopes
    long long alibi_batch_stride;    // elements between batch rows of alibi_slopes (0: one row for all)
    unsigned long long seed;         // dropout: Philox4x32-10 key (low word, high word)
    unsigned long long offset;       // dropout: low 32 bits -> counter word 3, high 32 bits xor'ed into key word 1
    const int* cu_seqlens_q;         // varlen: (batch + 1) int32 prefix sums, sequence b = packed query rows
    const int* cu_seqlens_k;         //   [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows likewise (varlen.cuh)
    const int* seqused_k;            // varlen: (batch,) int32 keys each sequence uses (<= its packed length), or null
    const int* block_table;          // varlen forward, paged K/V: (batch, >= page_capacity / page_size) int32 pages,
                                     //   or null: k, v packed like q (cu_seqlens_k rows)
    long long block_table_stride;    // elements between rows of block_table
    int window_left;                 // sliding window: query i sees keys j with
    int window_right;                //   d - window_left <= j <= d + window_right, d = i + seqlen_k - seqlen_q
                                     //   (+ diag_shift)
    float softcap_scale;             // softcap: softmax_scale / softcap; the score s becomes tanh(s * softcap_scale)
    float alibi_scale;               // ALiBi: slope -> bias per key in raw score units (1 / the softmax's unit scale)
    float dropout_rp;                // dropout: 1 / keep probability (keep_threshold / 256)
    unsigned int keep_threshold;     // dropout: an element is kept iff its 8-bit random number < keep_threshold
    int page_size;                   // paged varlen: tokens per page (a multiple of every key tile)
    int num_pages;                   //   pages of k, v (indices are clamped into [0, num_pages))
    int page_capacity;               //   keys a sequence can hold: block_table columns x page_size
    int diag_shift;                  // window and ALiBi kernels (forward, backward): d = i + seqlen_k - seqlen_q
                                     //   + diag_shift (masks.cuh diag_shift_of; a ring's chunk pairs); else 0
};

// n / d and n % d for 0 <= n < 2^31 by a multiply-high and a shift (flash_fwd.cuh fast_div, fast_divmod; the host's
// cuflash/params.py fast_divisor): a plain integer division compiles to a ~100-clock chain through the SFU
// (I2F, MUFU.RCP, F2I, corrections), which the persistent forward paid for each work item.
struct FastDiv {
    int d;                     // the divisor, >= 1
    unsigned int mul;          // ceil(2^(31 + l) / d), l = ceil(log2 d) (d == 1: 0, unused)
    unsigned int shift;        // l - 1 (d == 1: 0)
};

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
    struct ModParams mod;      // the variants (softcap: softmax_scale and scale_log2 are the softcap's)
    int sched_group;           // persistent Hopper forward: (head, batch) pairs per group of its walk (L2 reuse)
    // The forward's divisors (plan/forward.py fwd_walk), each a FastDiv of:
    struct FastDiv walk_step;  //   the persistent walk's stride in items (gridDim.x / cluster; else 1)
    struct FastDiv walk_items; //   sched_group * query items per (head, batch) pair: the walk's items per group
    struct FastDiv walk_units; //   sched_group * max(num_m_blocks / 2, 1): the paired walk's units per group
    struct FastDiv walk_group; //   sched_group (pairs per group)
    struct FastDiv walk_tail;  //   the last group's pairs (1..sched_group)
    struct FastDiv walk_heads; //   nheads: (head, batch) pair -> head, batch
    struct FastDiv kv_ratio;   //   head_ratio: query head -> kv head
};

// Parameter block shared by the three backward kernels (cuda_src/flash_bwd.cuh): preprocess,
// main (dK, dV and dQ partial sums) and the dQ convert. Same units as FwdParams.
struct BwdParams {
    const void* q;             // (batch, seqlen_q, nheads, head_dim)
    const void* k;             // (batch, seqlen_k, nheads_kv, head_dim)
    const void* v;             // (batch, seqlen_k, nheads_kv, head_dim)
    const void* o;             // forward output, shape of q
    const void* dout;          // gradient of the output, shape of q
    const float* lse;          // forward lse (batch, nheads, seqlen_q) float32, contiguous, natural log
    void* dq;                  // shape of q, dtype of q
    void* dk;                  // shape of k
    void* dv;                  // shape of v
    float* lse_log2;           // (batch, nheads, seqlen_q_pad): lse * log2(e); +inf for rows that see
                               // no key and for padding rows (their P is then exactly 0)
    float* dsum;               // (batch, nheads, seqlen_q_pad): D = rowsum(dO * O); 0 on padding rows
    float* dq_accum;           // (batch, nheads, seqlen_q_pad * dq_accum_cols) fp32, zeroed by the preprocess kernel;
                               // each query block's tile is stored in the main kernel's register order
                               // (see flash_bwd_convert_kernel), not row-major
    int* dq_turn;              // (batch, nheads, num_m_blocks) int32, zeroed: deterministic mode's turn counters
    int* item_counter;         // one int32, zeroed by the preprocess kernel: the persistent Hopper backward's
                               // next item (null for the other main kernels)
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    int batch;
    int nheads;
    int nheads_kv;
    int head_ratio;            // nheads / nheads_kv
    int seqlen_q;
    int seqlen_k;
    int head_dim;
    int seqlen_q_pad;          // num_m_blocks * kBlockM of the main kernel: rows of lse_log2 / dsum / dq_accum
    int dq_accum_cols;         // head-dim bucket of the main kernel: columns of dq_accum
    int num_m_blocks;          // ceil(seqlen_q / kBlockM)
    int deterministic;         // 1: dQ partial sums are added in kv-block order (bitwise reproducible)
    int block_m;               // kBlockM of the main kernel (rows of one dq_accum tile)
    int dq_q_warps;            // the main kernel's dQ warp grid: warps along the query rows ...
    int dq_tile_rows;          // ... and one warp's dQ tile: rows (multiple of 16) x
    int dq_tile_cols;          //     columns (multiple of 16)
    int pre_rows_per_warp;     // the preprocess's query rows per warp (1, 2, 4 or 8; 32 / rows lanes each)
    float softmax_scale;       // multiplies dS K and dS^T Q (the q.k scale, also with softcap)
    float scale_log2;          // log2(e) times the softmax's unit scale: softmax_scale, or softcap with softcap
    struct ModParams mod;
};

// Parameter block shared by the three decode kernels (cuda_src/flash_decode*.cuh): append, split-KV
// attention and combine. Same units as FwdParams. Sequence b attends to its first
// L_b = min(clamp(cached_b, 0, capacity) + seqlen_new, capacity) cache tokens, cached_b =
// seqlens[b] (or seqlen_const when seqlens is null).
struct DecodeParams {
    const void* q;             // (batch, seqlen_q, nheads, head_dim)
    void* k;                   // k_cache: (batch_cache, capacity, nheads_kv, head_dim) or paged
                               // (num_pages, page_size, nheads_kv, head_dim); written by the append kernel
    void* v;                   // v_cache, the layout of k_cache
    const void* k_new;         // (batch, seqlen_new, nheads_kv, head_dim) new tokens, or null
    const void* v_new;
    void* o;                   // (batch, seqlen_q, nheads, head_dim), dtype of q
    float* lse;                // (batch, nheads, seqlen_q) float32 contiguous, natural log; null: not wanted
    float* o_partial;          // (num_splits, batch, nheads, seqlen_q, partial_stride) fp32: normalized O of
                               // each split; null when num_splits == 1
    float* lse_partial;        // (num_splits, batch, nheads, seqlen_q) fp32: lse of each split
    int* split_counters;       // (batch, nheads_kv, num_row_blocks) int32, all 0 between launches: splits of
                               // each group done so far (num_splits > 1; the last one merges and resets it);
                               // null: no merge in the split kernel, the combine kernel runs after it
    const int* seqlens;        // (batch,) int32 tokens already cached, or null: seqlen_const for all
    const int* block_table;    // (batch, >= ceil(capacity / page_size)) int32 pages, or null: contiguous
    const int* cache_batch_idx;  // (batch,) int32: the cache row of sequence b (contiguous caches), or null: row b
    const int* cache_leftpad;    // (batch,) int32: sequence b's keys start at cache position cache_leftpad[b]
                                 // (window kernels only; the host turns it into a window), or null: 0
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride;  // elements between cache rows b (contiguous) or pages (paged)
    long long k_row_stride;    // elements between tokens (slots) of one cache row / page
    long long k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long k_new_batch_stride, k_new_row_stride, k_new_head_stride;
    long long v_new_batch_stride, v_new_row_stride, v_new_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long block_table_batch_stride;  // elements between rows of block_table
    int batch;
    int nheads;                // query heads
    int nheads_kv;             // key/value heads; nheads % nheads_kv == 0
    int group;                 // nheads / nheads_kv: query head h reads kv head h / group
    int seqlen_q;
    int rows;                  // group * seqlen_q: packed query rows per kv head (row r = i * group + j)
    int head_dim;              // real head dim (1..256); the kernel's bucket kHeadDim >= head_dim
    int seqlen_const;          // tokens already cached in every sequence when seqlens is null
    int seqlen_new;            // new tokens appended before attention (0: none)
    int capacity;              // tokens a sequence can hold: seqlen of the cache, or max_blocks * page_size
    int page_size;             // tokens per page (paged); capacity (contiguous)
    int num_pages;             // pages of the paged cache (page indices are clamped into [0, num_pages))
    int num_splits;            // key splits per sequence == the grid's split dim / num_row_blocks (1..128);
                               // tail-split grid: the splits of each tail group (the others are whole)
    int num_row_blocks;        // ceil(rows / kBlockM)
    int partial_stride;        // floats per row of o_partial (the head-dim bucket)
    int is_causal;             // 1: token i sees keys j <= L_b - seqlen_q + i
    int split_tiles;           // K/V tiles per split (the last one: the rest); 0: ceil(tiles / num_splits)
    int split_major;           // 1: grid (nheads_kv, batch, num_splits * num_row_blocks); 0: (that, nheads_kv, batch)
    float softmax_scale;       // multiplies q.k before the softmax (> 0)
    float scale_log2;          // softmax_scale * log2(e)
    int tail_groups;           // > 0: tail-split grid (1-D): the last tail_groups groups (b * nheads_kv + hk) in
                               // num_splits splits, every other group whole; 0: the grids above
    struct ModParams mod;      // window, softcap, ALiBi (no dropout in decode)
};

// Parameter block of the rotary kernel (cuda_src/rotary.cuh): rotary position embedding of the query
// tokens or the new key tokens of a decode call, written to a contiguous copy before the decode
// kernels read it. Token t of sequence b takes the row pos = base_b + (per_token ? t : 0) of cos / sin,
// base_b = clamp(seqlens[b] (or seqlen_const), 0, capacity) - leftpad[b], clamped into [0, seqlen_ro).
struct RotaryParams {
    const void* x;             // (batch, seqlen, nheads, head_dim), dtype of cos / sin
    void* out;                 // (batch, seqlen, nheads, head_dim) contiguous
    const void* cos;           // (seqlen_ro, rotary_dim / 2)
    const void* sin;
    const int* seqlens;        // (batch,) tokens already cached, or null: seqlen_const
    const int* leftpad;        // (batch,) or null: 0
    long long x_batch_stride, x_row_stride, x_head_stride;
    long long cos_row_stride;  // elements between rows of cos
    long long sin_row_stride;
    int batch;
    int seqlen;
    int nheads;
    int head_dim;
    int rotary_dim;            // channels rotated (even, <= head_dim); the rest are copied
    int seqlen_ro;             // rows of cos / sin
    int seqlen_const;
    int capacity;
    int per_token;
};

#ifdef __cplusplus
}  // namespace cuflash
#endif
