// A Mixture-of-Experts layer's routing and the combination of its experts' outputs, around
// quant_experts (quant_linear.cpp) for experts held in GGUF blocks (models/moe.py).
//
// Why native: at decode, a layer's routing and grouping on torch would be ~15 calls around one
// expert call, a large share of a step of a small-active-parameter model. The per-layer path
// (models/moe.py) and the fused decode loop (fused_decode.cpp) call these same functions, so the two
// agree bit for bit.
//
// Numerics: the router's softmax in fp32 (max subtracted, expf, summed in expert order); the top k
// picked largest first, the lower expert first on a tie; renormalized (when asked) by their sum in
// that order. A row's output is its experts' outputs times their weights, added in fp32 in ascending
// expert order from zero, then rounded once to the activations' dtype. A shared expert (Qwen2-MoE's)
// adds sigmoid(w_gate . x) times its output to that, in fp32 (moe_shared_expert).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "quant_formats.h"
#include "vec16.h"

extern "C" int quant_experts(const int64_t *gate_up, const int64_t *down, int64_t experts, const int64_t *offsets,
                             const void *x, int bf16, int64_t k, int64_t inter, void *out, int64_t hidden);
extern "C" int quant_linear_parts(const int64_t *parts_layout, const void *x, int64_t x_stride, int bf16, int64_t m,
                                  int64_t k, void *out, int64_t out_stride, const void *bias, const void *residual,
                                  int64_t residual_stride);
extern "C" void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t size);
extern "C" void fp32_linear(const float *x, int64_t x_stride, const float *w, float *out, int64_t out_stride,
                            const float *bias, int64_t m, int64_t n, int64_t k);

using quant_formats::kLayoutWords;

// chosen [rows, top_k] and weights [rows, top_k] from router logits [rows, experts] (fp32).
extern "C" __attribute__((optimize("fp-contract=off"))) void moe_route(const float *logits, int64_t rows,
                                                                      int64_t experts, int64_t top_k, int normalize,
                                                                      int64_t *chosen, float *weights) {
    static thread_local std::vector<float> probabilities;
    static thread_local std::vector<char> taken;
    probabilities.resize(static_cast<size_t>(experts));
    taken.resize(static_cast<size_t>(experts));
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = logits + r * experts;
        float top = row[0];
        for (int64_t e = 1; e < experts; ++e) top = std::max(top, row[e]);
        float sum = 0.0f;
        for (int64_t e = 0; e < experts; ++e) sum += probabilities[e] = expf(row[e] - top);
        for (int64_t e = 0; e < experts; ++e) probabilities[e] /= sum;
        std::fill(taken.begin(), taken.end(), 0);
        float picked_sum = 0.0f;
        for (int64_t j = 0; j < top_k; ++j) {
            int64_t best = -1;
            for (int64_t e = 0; e < experts; ++e)
                if (!taken[e] && (best < 0 || probabilities[e] > probabilities[best])) best = e;
            taken[best] = 1;
            chosen[r * top_k + j] = best;
            weights[r * top_k + j] = probabilities[best];
            picked_sum += probabilities[best];
        }
        if (normalize)
            for (int64_t j = 0; j < top_k; ++j) weights[r * top_k + j] /= picked_sum;
    }
}

// out [rows, k] (rows out_stride apart) = for each row of x [rows, k] (rows x_stride apart), the sum
// over its top_k experts (chosen, weights: [rows, top_k]) of weight x down_e(silu(gate_e x) * up_e x).
// gate_up_table, down_table: [experts, kLayoutWords] parts layouts of every expert of the layer. x and
// out are bf16 when bf16, else fp32. Returns 0 for a layout without a kernel.
extern "C" __attribute__((optimize("fp-contract=off"))) int moe_experts(
    const int64_t *gate_up_table, const int64_t *down_table, int64_t experts, const int64_t *chosen,
    const float *weights, int64_t rows, int64_t top_k, const void *x, int64_t x_stride, int bf16, int64_t k,
    int64_t inter, void *out, int64_t out_stride) {
    const int64_t entries = rows * top_k, size = bf16 ? 2 : 4;
    if (rows <= 0) return 1;
    static thread_local std::vector<int64_t> counts, next, order, used, offsets, gate_up, down;
    static thread_local std::vector<char> gathered, results;
    static thread_local std::vector<float> sums;
    // The entries (row, slot) grouped by expert, experts ascending, each expert's rows in order.
    counts.assign(static_cast<size_t>(experts) + 1, 0);
    for (int64_t i = 0; i < entries; ++i) counts[chosen[i] + 1]++;
    for (int64_t e = 0; e < experts; ++e) counts[e + 1] += counts[e];
    order.resize(static_cast<size_t>(entries));
    next.assign(counts.begin(), counts.end() - 1);
    for (int64_t i = 0; i < entries; ++i) order[next[chosen[i]]++] = i;
    used.clear(), offsets.assign(1, 0), gate_up.clear(), down.clear();
    for (int64_t e = 0; e < experts; ++e) {
        if (counts[e + 1] == counts[e]) continue;
        used.push_back(e);
        offsets.push_back(counts[e + 1]);
        gate_up.insert(gate_up.end(), gate_up_table + e * kLayoutWords, gate_up_table + (e + 1) * kLayoutWords);
        down.insert(down.end(), down_table + e * kLayoutWords, down_table + (e + 1) * kLayoutWords);
    }
    gathered.resize(static_cast<size_t>(entries * k * size));
    results.resize(static_cast<size_t>(entries * k * size));
    for (int64_t i = 0; i < entries; ++i)
        memcpy(gathered.data() + i * k * size, static_cast<const char *>(x) + order[i] / top_k * x_stride * size,
               static_cast<size_t>(k * size));
    if (!quant_experts(gate_up.data(), down.data(), static_cast<int64_t>(used.size()), offsets.data(),
                       gathered.data(), bf16, k, inter, results.data(), k))
        return 0;
    sums.assign(static_cast<size_t>(rows * k), 0.0f);
    for (int64_t i = 0; i < entries; ++i) {
        const int64_t entry = order[i], row = entry / top_k;
        const float weight = weights[entry];
        float *sum = sums.data() + row * k;
        if (bf16) {
            const uint16_t *result = reinterpret_cast<const uint16_t *>(results.data()) + i * k;
            for (int64_t c = 0; c < k; ++c) sum[c] += radixserve_vec::to_float(result[c]) * weight;
        } else {
            const float *result = reinterpret_cast<const float *>(results.data()) + i * k;
            for (int64_t c = 0; c < k; ++c) sum[c] += result[c] * weight;
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float *sum = sums.data() + r * k;
        if (bf16) {
            uint16_t *row = static_cast<uint16_t *>(out) + r * out_stride;
            for (int64_t c = 0; c < k; ++c) row[c] = radixserve_vec::float_to_bf16(sum[c]);
        } else {
            memcpy(static_cast<float *>(out) + r * out_stride, sum, static_cast<size_t>(k) * sizeof(float));
        }
    }
    return 1;
}

// out [rows, k] (rows out_stride apart) += sigmoid(gate . x_r) * down(silu(gate_up x_r)) for each row of
// x [rows, k] (fp32, rows x_stride apart): a shared expert every token takes, its gate_up (inter gate
// rows, then inter up rows) and down held in blocks (parts layouts), gate [k] fp32. The projections
// on quant_linear_parts and silu_and_mul, the gate on fp32_linear, sigmoid as 1 / (1 + e^-g).
// Returns 0 for a layout without a kernel.
extern "C" __attribute__((optimize("fp-contract=off"))) int moe_shared_expert(
    const int64_t *gate_up, const int64_t *down, const float *gate, const float *x, int64_t x_stride,
    int64_t rows, int64_t k, int64_t inter, float *out, int64_t out_stride) {
    if (rows <= 0) return 1;
    static thread_local std::vector<float> up, activated, shared, logits;
    up.resize(static_cast<size_t>(rows * 2 * inter));
    activated.resize(static_cast<size_t>(rows * inter));
    shared.resize(static_cast<size_t>(rows * k));
    logits.resize(static_cast<size_t>(rows));
    if (!quant_linear_parts(gate_up, x, x_stride, 0, rows, k, up.data(), 2 * inter, nullptr, nullptr, 0)) return 0;
    silu_and_mul_f32(up.data(), 2 * inter, activated.data(), rows, inter);
    if (!quant_linear_parts(down, activated.data(), inter, 0, rows, inter, shared.data(), k, nullptr, nullptr, 0))
        return 0;
    fp32_linear(x, x_stride, gate, logits.data(), 1, nullptr, rows, 1, k);
    for (int64_t r = 0; r < rows; ++r) {
        const float weight = 1.0f / (1.0f + expf(-logits[r]));
        float *row = out + r * out_stride;
        const float *add = shared.data() + r * k;
        for (int64_t i = 0; i < k; ++i) row[i] = row[i] + weight * add[i];
    }
    return 1;
}
