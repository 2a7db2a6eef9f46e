// Every decoder layer of a Llama-shaped model's decode step in one native call.
//
// Why: with the matmuls, attention and elementwise ops native, what was left of a decode step on a
// small CPU was mostly the Python and dispatch cost of ~15 calls per layer (figures in
// docs/architecture.md). This runs the same kernels in the same order, so its results are bit for
// bit those of the per-layer path (radixserve/models/llama.py); only the calls between them are gone.
//
// Per layer: RMSNorm; qkv = x W^T (+ bias); (OLMoE: q and k normed over their whole width, then q,
// k and v clamped to [-clip, clip]); rotary on the q and k heads; k, v stored to the pool at
// the new tokens' slots; attention (the prefix all requests share on AMX tiles, the rest by the
// paged decode kernel, merged by log-sum-exp); hidden += o_proj; RMSNorm; gate/up; SiLU·mul;
// hidden += down_proj. Qwen3's q/k norms (an RMSNorm per head) run between qkv and the rotary.
// Gemma 3's layers: every norm scales by 1 + weight, the attention's and the MLP's outputs are normed
// before they are added, GELU-tanh gates the MLP, and a sliding layer attends its window on rotary
// tables of its own (a window also skips the shared prefix: it may lie outside the window).
// A Mixture-of-Experts layer (fp32 only) replaces gate/up, SiLU·mul and down by the same native
// calls the per-layer path makes (moe.cpp): the router on fp32_linear, moe_route, moe_experts, and
// a shared expert's moe_shared_expert; then hidden += their output.
//
// The linears run on the kernel the weights are held for (the caller says which): the AMX matmul, or
// bf16_linear.cpp's on a CPU without AMX, for bf16 weights; quant_linear.cpp's for GGUF-quantized
// weights, with bf16 or fp32 activations (fused_decode_f32: the whole loop in fp32). The shared
// prefix runs on the prefix attention kernel the per-layer path uses for this head shape (the caller
// says which): AMX tiles or vector FMAs, bf16 only.
//
// fused_decode_f32_kv_bf16: fp32 activations over a bf16 KV pool (--kv-cache-dtype). As the
// per-layer path does (attention/base.py, AttentionCall), q, k and v are rounded to bf16, k and v
// stored, attention runs on the bf16 kernels, and its output is widened back to fp32.

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "amx_common.h"
#include "vec16.h"

extern "C" {
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *weight, uint16_t *out, int64_t rows,
                   int64_t size, float eps, int64_t unit_offset);
void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t size,
                  float eps, int64_t unit_offset);
void silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t size);
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t size);
void gelu_tanh_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t size);
void gelu_tanh_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t size);
void rotary_bf16(uint16_t *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim, int64_t rotary_dim,
                 const float *cos_table, const float *sin_table, const int64_t *positions);
void rotary_f32(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim, int64_t rotary_dim,
                const float *cos_table, const float *sin_table, const int64_t *positions);
int decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                          const int64_t *req_to_token, int64_t table_stride, const int64_t *req_rows,
                          const int64_t *lens, uint16_t *out, int64_t batch, int64_t heads, int64_t kv_heads,
                          int64_t head_dim, float scale, int64_t prefix_length, const uint16_t *prefix_out,
                          int64_t prefix_head_stride, int64_t prefix_row_stride, const float *prefix_lse,
                          int64_t window);
int decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                         const int64_t *req_to_token, int64_t table_stride, const int64_t *req_rows,
                         const int64_t *lens, float *out, int64_t batch, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, float scale, int64_t prefix_length, const float *prefix_out,
                         int64_t prefix_head_stride, int64_t prefix_row_stride, const float *prefix_lse,
                         int64_t window);
void bf16_linear(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *out, int64_t out_stride,
                 const uint16_t *bias, const uint16_t *residual, int64_t residual_stride, int64_t m, int64_t n,
                 int64_t k);
void amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, uint16_t *out, int64_t out_stride,
                     const uint16_t *bias, const uint16_t *residual, int64_t residual_stride, int64_t m, int64_t n,
                     int64_t k);
int quant_linear_parts(const int64_t *parts_layout, const void *x, int64_t x_stride, int bf16, int64_t m, int64_t k,
                       void *out, int64_t out_stride, const void *bias, const void *residual, int64_t residual_stride);
void fp32_linear(const float *x, int64_t x_stride, const float *w, float *out, int64_t out_stride, const float *bias,
                 int64_t m, int64_t n, int64_t k);
void moe_route(const float *logits, int64_t rows, int64_t experts, int64_t top_k, int normalize, int64_t *chosen,
               float *weights);
int moe_experts(const int64_t *gate_up_table, const int64_t *down_table, int64_t experts, const int64_t *chosen,
                const float *weights, int64_t rows, int64_t top_k, const void *x, int64_t x_stride, int bf16, int64_t k,
                int64_t inter, void *out, int64_t out_stride);
int moe_shared_expert(const int64_t *gate_up, const int64_t *down, const float *gate, const float *x, int64_t x_stride,
                      int64_t rows, int64_t k, int64_t inter, float *out, int64_t out_stride);
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

using namespace radixserve_vec;

// What the linears run on (fused_decode_*'s linear_kind).
enum LinearKind : int64_t { kAmx = 0, kBf16 = 1, kQuantized = 2 };

// One layer's weights and its K/V pool, as pointers. A linear is a packed bf16 weight, or (kQuantized)
// the int64 parts layout of quant_linear_parts. KV: the pool's element type. q_norm, k_norm: null
// without q/k norms. router: null for a dense MLP; else the layer is a Mixture of Experts, its
// router [experts, hidden] fp32 and its experts' gate_up and down layouts [experts, 10] (moe.cpp).
// attn_out_norm, mlp_out_norm: Gemma's norms of the attention's and the MLP's outputs before each is
// added to the residual stream (null: added as they come). window: a sliding layer's window (0: none);
// local_rope: whether the layer turns on the step's second rotary tables (Gemma's sliding layers).
// shared_gate_up, shared_down, shared_gate: a Mixture-of-Experts layer's shared expert (Qwen2-MoE's;
// null: none), its projections' parts layouts and its gate [hidden] fp32 (moe.cpp).
template <typename T, typename KV>
struct Layer {
    const T *input_norm;
    const void *qkv;
    const T *qkv_bias;
    const void *o;
    const T *post_norm;
    const void *gate_up, *down;
    KV *k_cache, *v_cache;
    const T *q_norm, *k_norm;
    const float *router;
    const int64_t *gate_up_table, *down_table;
    const T *attn_out_norm, *mlp_out_norm;
    int64_t window, local_rope;
    const int64_t *shared_gate_up, *shared_down;
    const float *shared_gate;
};

// n values converted to bf16, rounded as torch's .to() rounds (vec16.h), and back.
inline void convert(const float *from, uint16_t *to, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store16(to + i, load16(from + i));
    if (i < n) {
        float tail[16] = {};
        uint16_t out[16];
        memcpy(tail, from + i, (n - i) * sizeof(float));
        store16(out, load16(tail));
        memcpy(to + i, out, (n - i) * sizeof(uint16_t));
    }
}
inline void convert(const uint16_t *from, float *to, int64_t n) {
    for (int64_t i = 0; i < n; i++) to[i] = to_float(from[i]);
}

struct Shape {
    // rotary_dim: the dimensions of each head the rotary turns (fewer than head_dim under a partial
    // rotary factor).
    int64_t batch, hidden, intermediate, heads, kv_heads, head_dim, rotary_dim;
    // Mixture-of-Experts layers: experts, experts per token, whether their weights are
    // renormalized, each expert's intermediate size, and the shared expert's.
    int64_t experts, top_k, normalize, expert_intermediate, shared_intermediate;
};

// The element type's kernels (bf16 as uint16_t, or fp32).
template <typename T>
struct Ops;
template <>
struct Ops<uint16_t> {
    static constexpr auto rms_norm = rms_norm_bf16;
    static constexpr auto silu_and_mul = silu_and_mul_bf16;
    static constexpr auto gelu_tanh_and_mul = gelu_tanh_and_mul_bf16;
    static constexpr auto rotary = rotary_bf16;
    static constexpr auto decode_attention = decode_attention_bf16;
};
template <>
struct Ops<float> {
    static constexpr auto rms_norm = rms_norm_f32;
    static constexpr auto silu_and_mul = silu_and_mul_f32;
    static constexpr auto gelu_tanh_and_mul = gelu_tanh_and_mul_f32;
    static constexpr auto rotary = rotary_f32;
    static constexpr auto decode_attention = decode_attention_f32;
};

// The model's norms and MLP gate: kUnitOffsetNorms (Gemma) scales every RMSNorm by 1 + weight;
// kGeluTanh gates the MLP by GELU's tanh approximation in place of SiLU; kFullWidthQkNorms (OLMoE)
// norms q and k each over its whole projection rather than per head.
enum Flavor : int64_t { kUnitOffsetNorms = 1, kGeluTanh = 2, kFullWidthQkNorms = 4 };

struct Step {
    int64_t linear_kind, prefix_kind, flavor;
    // clip: q, k and v clamped to [-clip, clip] after their norms (OLMoE's clip_qkv); 0: none.
    float eps, scale, clip;
    const float *cos_table, *sin_table, *local_cos_table, *local_sin_table;
    const int64_t *positions, *out_slots, *req_to_token;
    int64_t table_stride;
    const int64_t *req_rows, *seq_lens;
    int64_t prefix_length;
    const int64_t *prefix_slots;
    // Where the sliding layers' K/V lie in window slots of their own (radixserve/cache/swa_pool.py):
    // the new tokens' window slots and each request's context as window slots, in its row of that
    // table. Else the same as out_slots, req_to_token, table_stride and req_rows.
    const int64_t *window_out_slots, *window_req_to_token;
    int64_t window_table_stride;
    const int64_t *window_req_rows;
};

template <typename T>
int linear(const Step &step, const void *w, const T *x, int64_t x_stride, T *out, int64_t out_stride, const T *bias,
           const T *residual, int64_t residual_stride, int64_t m, int64_t n, int64_t k) {
    if (step.linear_kind == kQuantized)
        return quant_linear_parts(static_cast<const int64_t *>(w), x, x_stride, sizeof(T) == 2, m, k, out, out_stride,
                                  bias, residual, residual_stride)
                   ? 0
                   : 1;
    if constexpr (sizeof(T) == 2) {
        auto *packed_linear = step.linear_kind == kAmx ? amx_linear_bf16 : bf16_linear;
        packed_linear(x, x_stride, static_cast<const uint16_t *>(w), out, out_stride, bias, residual, residual_stride,
                      m, n, k);
        return 0;
    }
    return 1;  // packed weights are bf16 only
}

// x [rows, size] (rows x_stride apart) normed into out by weight, as the model's RMSNorm does.
template <typename T>
void norm(const Step &step, const T *x, int64_t x_stride, const T *weight, T *out, int64_t rows, int64_t size) {
    Ops<T>::rms_norm(x, x_stride, weight, out, rows, size, step.eps, step.flavor & kUnitOffsetNorms);
}

// hidden += x (n values), added in fp32 and rounded once, as torch adds two tensors of T.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void add_to(T *hidden, const T *x, int64_t n) {
    for (int64_t i = 0; i < n; i += kLanes) store_n(hidden + i, load_n(hidden + i, n - i) + load_n(x + i, n - i), n - i);
}

template <typename T, typename KV>
int run_layers(const Step &step, const Layer<T, KV> *layers, int64_t num_layers, T *hidden, const Shape &s) {
    const int64_t q_width = s.heads * s.head_dim, kv_width = s.kv_heads * s.head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width, prefix_rows = s.batch * (s.heads / s.kv_heads);
    static thread_local std::vector<T> workspace;
    static thread_local std::vector<KV> kv_workspace;  // q and the attention's output, where KV != T
    static thread_local std::vector<float> prefix_lse;
    const int64_t normed_size = s.batch * s.hidden, qkv_size = s.batch * qkv_width, attn_size = s.batch * q_width;
    const int64_t gate_up_size = s.batch * 2 * s.intermediate, act_size = s.batch * s.intermediate;
    const int64_t prefix_size = step.prefix_length ? s.kv_heads * prefix_rows * s.head_dim : 0;
    constexpr bool kConverts = !std::is_same_v<T, KV>;
    const size_t needed = static_cast<size_t>(normed_size + qkv_size + attn_size + gate_up_size + act_size +
                                              (kConverts ? 0 : prefix_size));
    if (workspace.size() < needed) workspace.resize(needed);
    const size_t kv_needed = kConverts ? static_cast<size_t>(2 * attn_size + prefix_size) : 0;
    if (kv_workspace.size() < kv_needed) kv_workspace.resize(kv_needed);
    if (step.prefix_length && prefix_lse.size() < static_cast<size_t>(s.kv_heads * prefix_rows))
        prefix_lse.resize(s.kv_heads * prefix_rows);
    T *normed = workspace.data(), *qkv = normed + normed_size, *attn = qkv + qkv_size;
    T *gate_up = attn + attn_size, *act = gate_up + gate_up_size;
    static thread_local std::vector<float> router_logits, expert_weights;
    static thread_local std::vector<int64_t> chosen;
    static thread_local std::vector<T> experts_out;
    if (s.experts) {
        router_logits.resize(static_cast<size_t>(s.batch * s.experts));
        expert_weights.resize(static_cast<size_t>(s.batch * s.top_k));
        chosen.resize(static_cast<size_t>(s.batch * s.top_k));
        experts_out.resize(static_cast<size_t>(normed_size));
    }
    // What attention reads and writes, in the pool's type: views of the above where KV is T, else
    // converted copies (q, its output, and the prefix's output).
    KV *q_kv, *attn_kv, *prefix_out;
    if constexpr (kConverts) {
        q_kv = kv_workspace.data(), attn_kv = q_kv + attn_size, prefix_out = attn_kv + attn_size;
    } else {
        q_kv = qkv, attn_kv = attn, prefix_out = act + act_size;
    }
    const int64_t q_kv_stride = kConverts ? q_width : qkv_width;

    for (int64_t l = 0; l < num_layers; l++) {
        const Layer<T, KV> &w = layers[l];
        norm(step, hidden, s.hidden, w.input_norm, normed, s.batch, s.hidden);
        if (linear<T>(step, w.qkv, normed, s.hidden, qkv, qkv_width, w.qkv_bias, nullptr, 0, s.batch, qkv_width,
                      s.hidden))
            return 300;
        if (w.q_norm) {
            for (int64_t b = 0; b < s.batch; b++) {
                T *row = qkv + b * qkv_width;
                if (step.flavor & kFullWidthQkNorms) {
                    norm(step, row, q_width, w.q_norm, row, 1, q_width);
                    norm(step, row + q_width, kv_width, w.k_norm, row + q_width, 1, kv_width);
                } else {
                    norm(step, row, s.head_dim, w.q_norm, row, s.heads, s.head_dim);
                    norm(step, row + q_width, s.head_dim, w.k_norm, row + q_width, s.kv_heads, s.head_dim);
                }
            }
        }
        if (step.clip > 0) {
            if constexpr (std::is_same_v<T, float>) {
                for (int64_t i = 0; i < qkv_size; i++) qkv[i] = std::min(std::max(qkv[i], -step.clip), step.clip);
            } else {
                return 500;  // clipped qkv runs fused in fp32 only
            }
        }
        // Query and key heads are adjacent: rotated together.
        Ops<T>::rotary(qkv, qkv_width, s.batch, s.heads + s.kv_heads, s.head_dim, s.rotary_dim,
                       w.local_rope ? step.local_cos_table : step.cos_table,
                       w.local_rope ? step.local_sin_table : step.sin_table, step.positions);
        const int64_t *out_slots = w.window ? step.window_out_slots : step.out_slots;
        for (int64_t b = 0; b < s.batch; b++) {
            const T *row = qkv + b * qkv_width;
            KV *k_slot = w.k_cache + out_slots[b] * kv_width, *v_slot = w.v_cache + out_slots[b] * kv_width;
            if constexpr (kConverts) {
                convert(row, q_kv + b * q_width, q_width);
                convert(row + q_width, k_slot, kv_width);
                convert(row + q_width + kv_width, v_slot, kv_width);
            } else {
                memcpy(k_slot, row + q_width, kv_width * sizeof(T));
                memcpy(v_slot, row + q_width + kv_width, kv_width * sizeof(T));
            }
        }
        // A sliding layer reads each request's window alone: the shared prefix may lie outside it.
        const int64_t prefix_length = w.window ? 0 : step.prefix_length;
        if (prefix_length) {
            if constexpr (sizeof(KV) == 2) {
                auto *prefix_attention = step.prefix_kind == 0 ? amx_prefix_attention_bf16 : prefix_attention_bf16;
                const int status = prefix_attention(q_kv, q_kv_stride, w.k_cache, w.v_cache, kv_width, step.prefix_slots,
                                                    prefix_out, 0, prefix_lse.data(), s.batch, s.heads, s.kv_heads,
                                                    s.head_dim, step.prefix_length, step.scale, -1);
                if (status) return 100 + status;
            } else {
                return 100;  // the prefix attention kernels are bf16 only
            }
        }
        const int status = Ops<KV>::decode_attention(
            q_kv, q_kv_stride, w.k_cache, w.v_cache, w.window ? step.window_req_to_token : step.req_to_token,
            w.window ? step.window_table_stride : step.table_stride, w.window ? step.window_req_rows : step.req_rows,
            step.seq_lens, attn_kv, s.batch, s.heads, s.kv_heads, s.head_dim, step.scale, prefix_length,
            prefix_length ? prefix_out : nullptr, prefix_rows * s.head_dim, s.head_dim,
            prefix_length ? prefix_lse.data() : nullptr, w.window);
        if (status) return 200 + status;
        if constexpr (kConverts) convert(attn_kv, attn, attn_size);
        if (w.attn_out_norm) {
            if (linear<T>(step, w.o, attn, q_width, normed, s.hidden, nullptr, nullptr, 0, s.batch, s.hidden, q_width))
                return 300;
            norm(step, normed, s.hidden, w.attn_out_norm, normed, s.batch, s.hidden);
            add_to(hidden, normed, normed_size);
        } else if (linear<T>(step, w.o, attn, q_width, hidden, s.hidden, nullptr, hidden, s.hidden, s.batch,
                             s.hidden, q_width)) {
            return 300;
        }
        norm(step, hidden, s.hidden, w.post_norm, normed, s.batch, s.hidden);
        if (w.router) {
            if constexpr (std::is_same_v<T, float>) {
                fp32_linear(normed, s.hidden, w.router, router_logits.data(), s.experts, nullptr, s.batch, s.experts,
                            s.hidden);
                moe_route(router_logits.data(), s.batch, s.experts, s.top_k, static_cast<int>(s.normalize),
                          chosen.data(), expert_weights.data());
                if (!moe_experts(w.gate_up_table, w.down_table, s.experts, chosen.data(), expert_weights.data(),
                                 s.batch, s.top_k, normed, s.hidden, 0, s.hidden, s.expert_intermediate,
                                 experts_out.data(), s.hidden))
                    return 300;
                if (w.shared_gate_up &&
                    !moe_shared_expert(w.shared_gate_up, w.shared_down, w.shared_gate, normed, s.hidden, s.batch,
                                       s.hidden, s.shared_intermediate, experts_out.data(), s.hidden))
                    return 300;
                for (int64_t i = 0; i < normed_size; i++) hidden[i] = experts_out[i] + hidden[i];
                continue;
            } else {
                return 400;  // Mixture-of-Experts layers run fused in fp32 only
            }
        }
        if (linear<T>(step, w.gate_up, normed, s.hidden, gate_up, 2 * s.intermediate, nullptr, nullptr, 0, s.batch,
                      2 * s.intermediate, s.hidden))
            return 300;
        auto *gate = step.flavor & kGeluTanh ? Ops<T>::gelu_tanh_and_mul : Ops<T>::silu_and_mul;
        gate(gate_up, 2 * s.intermediate, act, s.batch, s.intermediate);
        if (w.mlp_out_norm) {
            if (linear<T>(step, w.down, act, s.intermediate, normed, s.hidden, nullptr, nullptr, 0, s.batch, s.hidden,
                          s.intermediate))
                return 300;
            norm(step, normed, s.hidden, w.mlp_out_norm, normed, s.batch, s.hidden);
            add_to(hidden, normed, normed_size);
        } else if (linear<T>(step, w.down, act, s.intermediate, hidden, s.hidden, nullptr, hidden, s.hidden, s.batch,
                             s.hidden, s.intermediate)) {
            return 300;
        }
    }
    return 0;
}

}  // namespace

// hidden [batch, hidden] is the residual stream, updated in place. linear_kind: 0 the AMX matmul, 1
// bf16_linear, 2 quant_linear_parts; prefix_kind: 0 the AMX prefix attention, 1 the vector one;
// flavor: Flavor's bits; local_cos/sin_table: the rotary tables of layers with local_rope. Returns 0; 1 for AMX asked of a build without it; or the failing
// kernel's status (the caller checked every condition first, so any is a bug).
#define RADIXSERVE_FUSED_DECODE(NAME, T, KV)                                                                       \
    extern "C" int NAME(int64_t linear_kind, int64_t prefix_kind, int64_t flavor, const Layer<T, KV> *layers,     \
                        int64_t num_layers, T *hidden, int64_t batch, int64_t hidden_size, int64_t intermediate,  \
                        int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, float eps,         \
                        float scale, float clip,                                                                  \
                        const float *cos_table, const float *sin_table, const float *local_cos_table,             \
                        const float *local_sin_table, const int64_t *positions,                                   \
                        const int64_t *out_slots, const int64_t *req_to_token, int64_t table_stride,              \
                        const int64_t *req_rows, const int64_t *seq_lens, int64_t prefix_length,                  \
                        const int64_t *prefix_slots, const int64_t *window_out_slots,                             \
                        const int64_t *window_req_to_token, int64_t window_table_stride,                          \
                        const int64_t *window_req_rows, int64_t experts, int64_t top_k, int64_t normalize,        \
                        int64_t expert_intermediate, int64_t shared_intermediate) {                               \
        if (!amx_allowed(linear_kind, prefix_kind, prefix_length)) return 1;                                     \
        const Step step{linear_kind,  prefix_kind,     flavor,          eps,          scale,        clip,      \
                        cos_table,    sin_table,       local_cos_table, local_sin_table, positions,             \
                        out_slots,    req_to_token,    table_stride,    req_rows,        seq_lens,              \
                        prefix_length, prefix_slots, window_out_slots, window_req_to_token,                     \
                        window_table_stride, window_req_rows};                                                  \
        return run_layers<T, KV>(step, layers, num_layers, hidden,                                               \
                             Shape{batch, hidden_size, intermediate, heads, kv_heads, head_dim, rotary_dim,      \
                                   experts, top_k, normalize, expert_intermediate, shared_intermediate});        \
    }

namespace {
bool amx_allowed(int64_t linear_kind, int64_t prefix_kind, int64_t prefix_length) {
#ifndef RADIXSERVE_AMX
    return !(linear_kind == kAmx || (prefix_length && prefix_kind == 0));
#else
    (void)linear_kind, (void)prefix_kind, (void)prefix_length;
    return true;
#endif
}
}  // namespace

RADIXSERVE_FUSED_DECODE(fused_decode_bf16, uint16_t, uint16_t)
RADIXSERVE_FUSED_DECODE(fused_decode_f32, float, float)
RADIXSERVE_FUSED_DECODE(fused_decode_f32_kv_bf16, float, uint16_t)
