// Every decoder layer of a Llama-shaped model's decode step in one native call.
//
// Why: with the matmuls, attention and elementwise ops native, what was left of a decode step on a
// small CPU was mostly the Python and dispatch cost of ~15 calls per layer (figures in
// docs/architecture.md). This runs the same kernels in the same order, so its results are bit for
// bit those of the per-layer path (radixserve/models/llama.py); only the calls between them are gone.
//
// Per layer: RMSNorm; qkv = x W^T (+ bias); rotary on the q and k heads; k, v stored to the pool at
// the new tokens' slots; attention (the prefix all requests share on AMX tiles, the rest by the
// paged decode kernel, merged by log-sum-exp); hidden += o_proj; RMSNorm; gate/up; SiLU·mul;
// hidden += down_proj.
//
// The linears run on the kernel the weights were packed for (the caller says which): the AMX matmul,
// or bf16_linear.cpp's on a CPU without AMX. The shared prefix runs on the prefix attention kernel the
// per-layer path uses for this head shape (the caller says which): AMX tiles or vector FMAs.

#include <stdint.h>
#include <string.h>

#include <vector>

#include "amx_common.h"

extern "C" {
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight, uint16_t *out, int64_t rows,
                   int64_t size, float eps);
void silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t size);
void rotary_bf16(uint16_t *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim, const float *cos_table,
                 const float *sin_table, const int64_t *positions);
int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int64_t *req_to_token, int64_t table_stride, const int64_t *req_rows,
                          const int64_t *lens, uint16_t *out, int64_t batch, int64_t heads, int64_t kv_heads,
                          int64_t head_dim, float scale, int64_t prefix_length, const uint16_t *prefix_out,
                          int64_t prefix_head_stride, int64_t prefix_row_stride, const float *prefix_lse);
void bf16_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *out, int64_t out_stride,
                 const uint16_t *bias, const uint16_t *residual, int64_t residual_stride, int64_t m, int64_t n,
                 int64_t k);
void amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *out, int64_t out_stride,
                     const uint16_t *bias, const uint16_t *residual, int64_t residual_stride, int64_t m, int64_t n,
                     int64_t k);
int prefix_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v, int64_t kv_stride,
                          const int64_t *slots, uint16_t *out, int64_t out_token, float *lse, int64_t n,
                          int64_t heads, int64_t kv_heads, int64_t dim, int64_t length, float scale,
                          int64_t causal_offset);
int amx_prefix_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                              int64_t kv_stride, const int64_t *slots, uint16_t *out, int64_t out_token,
                              float *lse, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim, int64_t length,
                              float scale, int64_t causal_offset);
}

namespace {

// One layer's weights (linears packed for the kernel named by fused_decode_bf16's linear_kind) and its
// K/V pool, as pointers.
struct Layer {
    const uint16_t *input_norm, *qkv, *qkv_bias, *o, *post_norm, *gate_up, *down;
    uint16_t *k_cache, *v_cache;
};

struct Shape {
    int64_t batch, hidden, intermediate, heads, kv_heads, head_dim;
};

}  // namespace

// hidden [batch, hidden] is the residual stream, updated in place. linear_kind: 0 the AMX matmul, 1
// bf16_linear; prefix_kind: 0 the AMX prefix attention, 1 the vector one. Returns 0; 1 for AMX asked
// of a build without it; or the failing kernel's status (the caller checked every condition first,
// so any is a bug).
extern "C" int fused_decode_bf16(int64_t linear_kind, int64_t prefix_kind, const Layer *layers, int64_t num_layers, uint16_t *hidden, int64_t batch,
                                 int64_t hidden_size, int64_t intermediate, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, float eps, float scale, const float *cos_table,
                                 const float *sin_table, const int64_t *positions, const int64_t *out_slots,
                                 const int64_t *req_to_token, int64_t table_stride, const int64_t *req_rows,
                                 const int64_t *seq_lens, int64_t prefix_length, const int64_t *prefix_slots) {
#ifndef RADIXSERVE_AMX
    if (linear_kind == 0 || (prefix_length && prefix_kind == 0)) return 1;
#endif
    auto *linear = linear_kind == 0 ? amx_linear_bf16 : bf16_linear;
    auto *prefix_attention = prefix_kind == 0 ? amx_prefix_attention_bf16 : prefix_attention_bf16;
    const Shape s{batch, hidden_size, intermediate, heads, kv_heads, head_dim};
    const int64_t q_width = s.heads * s.head_dim, kv_width = s.kv_heads * s.head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width, prefix_rows = s.batch * (s.heads / s.kv_heads);
    static thread_local std::vector<uint16_t> workspace;
    static thread_local std::vector<float> prefix_lse;
    const int64_t normed_size = s.batch * s.hidden, qkv_size = s.batch * qkv_width, attn_size = s.batch * q_width;
    const int64_t gate_up_size = s.batch * 2 * s.intermediate, act_size = s.batch * s.intermediate;
    const int64_t prefix_size = prefix_length ? s.kv_heads * prefix_rows * s.head_dim : 0;
    const size_t needed =
        static_cast<size_t>(normed_size + qkv_size + attn_size + gate_up_size + act_size + prefix_size);
    if (workspace.size() < needed) workspace.resize(needed);
    if (prefix_length && prefix_lse.size() < static_cast<size_t>(s.kv_heads * prefix_rows))
        prefix_lse.resize(s.kv_heads * prefix_rows);
    uint16_t *normed = workspace.data(), *qkv = normed + normed_size, *attn = qkv + qkv_size;
    uint16_t *gate_up = attn + attn_size, *act = gate_up + gate_up_size, *prefix_out = act + act_size;

    for (int64_t l = 0; l < num_layers; l++) {
        const Layer &w = layers[l];
        rms_norm_bf16(hidden, s.hidden, w.input_norm, normed, s.batch, s.hidden, eps);
        linear(normed, s.hidden, w.qkv, qkv, qkv_width, w.qkv_bias, nullptr, 0, s.batch, qkv_width,
                        s.hidden);
        // Query and key heads are adjacent: rotated together.
        rotary_bf16(qkv, qkv_width, s.batch, s.heads + s.kv_heads, s.head_dim, cos_table, sin_table, positions);
        for (int64_t b = 0; b < s.batch; b++) {
            const uint16_t *row = qkv + b * qkv_width;
            memcpy(w.k_cache + out_slots[b] * kv_width, row + q_width, kv_width * 2);
            memcpy(w.v_cache + out_slots[b] * kv_width, row + q_width + kv_width, kv_width * 2);
        }
        if (prefix_length) {
            const int status =
                prefix_attention(qkv, qkv_width, w.k_cache, w.v_cache, kv_width, prefix_slots, prefix_out,
                                          0, prefix_lse.data(), s.batch, s.heads, s.kv_heads, s.head_dim,
                                          prefix_length, scale, -1);
            if (status) return 100 + status;
        }
        const int status = decode_attention_bf16(
            qkv, qkv_width, w.k_cache, w.v_cache, req_to_token, table_stride, req_rows, seq_lens, attn, s.batch,
            s.heads, s.kv_heads, s.head_dim, scale, prefix_length, prefix_length ? prefix_out : nullptr,
            prefix_rows * s.head_dim, s.head_dim, prefix_length ? prefix_lse.data() : nullptr);
        if (status) return 200 + status;
        linear(attn, q_width, w.o, hidden, s.hidden, nullptr, hidden, s.hidden, s.batch, s.hidden, q_width);
        rms_norm_bf16(hidden, s.hidden, w.post_norm, normed, s.batch, s.hidden, eps);
        linear(normed, s.hidden, w.gate_up, gate_up, 2 * s.intermediate, nullptr, nullptr, 0, s.batch,
                        2 * s.intermediate, s.hidden);
        silu_and_mul_bf16(gate_up, 2 * s.intermediate, act, s.batch, s.intermediate);
        linear(act, s.intermediate, w.down, hidden, s.hidden, nullptr, hidden, s.hidden, s.batch, s.hidden,
                        s.intermediate);
    }
    return 0;
}
