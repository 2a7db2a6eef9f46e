// Attention of many queries over one run of keys they all see (the prefix every request of a batch
// shares, cascade attention), on fp32 vector FMAs: the CPUs without AMX (amx_attention.cpp has the
// tile version of the same contract).
//
// Why: without it, a decode step whose requests share a prefix ran the shared part on torch's flash
// kernel, which no native kernel reproduces bit for bit, so such steps could not run in the fused
// decode loop (fused_decode.cpp) and went layer by layer through Python.
//
// Shapes and outputs exactly as amx_prefix_attention_bf16: q [N, H, D] (row n's head j at q + n *
// q_stride + j * D); key i's head h at k + row(i) * kv_stride + h * D (row(i) = slots[i], or i); out
// [Hkv, N * G, D] and lse [Hkv, N * G] (natural log), or [N, H, D] rows out_token apart.
//
// Numerics: scores are fp32 sums over the head dimension in order (one fused multiply-add per
// element); softmax in fp32; probabilities rounded to bf16 for the product with V, as the AMX kernel
// and torch's flash kernel do; that product summed over keys in order; one rounding of the output.
// Every sum has one order whatever the vector width, so AVX2 and AVX-512 builds give the same bits.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "vec16.h"

namespace {

using namespace radixserve_vec;

constexpr int64_t kRows = 12;      // query rows per task
constexpr int64_t kValueRows = 6;  // query rows per P V micro-tile

// The score and P V loops run on the CPU's native vector width (vec16.h's vec): each output lane
// is its own in-order sum, so the width changes no bit.
#if defined(__AVX512F__)
// Query rows per score micro-tile (16 keys) and output columns per P V micro-tile: enough
// independent accumulators to keep both FMA pipes busy, few enough to stay in the 32 registers.
constexpr int64_t kScoreRows = 12;
constexpr int64_t kTileCols = 48;
#else
constexpr int64_t kScoreRows = 6;  // the same with 16 registers
constexpr int64_t kTileCols = 16;
#endif
static_assert(kRows % kScoreRows == 0 && kRows % kValueRows == 0, "micro-tiles must tile a task's rows");

struct Problem {
    const uint16_t *q;
    int64_t q_stride;
    const uint16_t *k, *v;
    int64_t kv_stride;
    const int64_t *slots;
    uint16_t *out;
    int64_t out_token, out_head, out_query;
    float *lse;
    int64_t n, kv_heads, group, dim, length;
    float scale;
    int64_t causal_offset;  // < 0: every query sees every key; else token t sees keys < offset + t + 1

    int64_t rows() const { return n * group; }
    int64_t visible(int64_t r) const {
        return causal_offset < 0 ? length : std::min(length, causal_offset + r / group + 1);
    }
    int64_t padded_length() const { return (length + 15) / 16 * 16; }
    const uint16_t *key(int64_t i, int64_t h) const { return k + (slots ? slots[i] : i) * kv_stride + h * dim; }
    const uint16_t *value(int64_t i, int64_t h) const {
        return v + (slots ? slots[i] : i) * kv_stride + h * dim;
    }
};

// Keys [16 * block, +16) of head h, transposed and widened to fp32 (once, not once per query block)
// as one contiguous [D][16] block: dst[d * 16 + i] is dimension d of key 16 * block + i, so one vector
// load gives a dimension of 16 keys, and a block's loads are one sequential run (as [D][length]
// rows, the 2 KB-apart lines of a 512-key prefix fell into a few L1 sets and thrashed). Past the end:
// zero.
void pack_keys(const Problem &p, int64_t h, int64_t block, float *dst) {
    for (int64_t i = 0; i < 16; i++) {
        const int64_t key = block * 16 + i;
        if (key < p.length) {
            const uint16_t *row = p.key(key, h);
            for (int64_t d = 0; d < p.dim; d++) dst[d * 16 + i] = to_float(row[d]);
        } else {
            for (int64_t d = 0; d < p.dim; d++) dst[d * 16 + i] = 0.0f;
        }
    }
}

// Values [16 * block, +16) of head h, widened to fp32, in 16-column strips: dst[(c * padded + i) *
// 16 + j] is column 16 * c + j of value i, so P V's pass over a strip reads one sequential run. Past
// the end: zero.
void pack_values(const Problem &p, int64_t h, int64_t block, float *dst) {
    const int64_t padded = p.padded_length();
    for (int64_t i = block * 16; i < block * 16 + 16; i++)
        for (int64_t c = 0; c < p.dim / 16; c++) {
            float *strip = dst + (c * padded + i) * 16;
            if (i < p.length)
                for (int64_t j = 0; j < 16; j += kLanes) store_vec(strip + j, load_vec(p.value(i, h) + 16 * c + j));
            else
                memset(strip, 0, 64);
        }
}

// Scores of query rows [r0, r0 + kScoreRows) (fp32, [kScoreRows][D] in `queries`) against keys
// [0, width): scores[r][i] = q_r . k_i, summed over d in order.
void score_rows(const Problem &p, const float *queries, const float *keys, int64_t width, float *scores) {
    constexpr int64_t kVecs = 16 / kLanes;
    const int64_t padded = p.padded_length();
    for (int64_t i = 0; i < width; i += 16) {
        vec acc[kScoreRows][kVecs] = {};
        for (int64_t d = 0; d < p.dim; d++) {
            vec key[kVecs];
            for (int64_t c = 0; c < kVecs; c++) key[c] = load_vec(keys + i * p.dim + d * 16 + c * kLanes);
            for (int64_t r = 0; r < kScoreRows; r++) {
                const vec query = broadcast(queries[r * p.dim + d]);
                for (int64_t c = 0; c < kVecs; c++) acc[r][c] = fma_lanes(query, key[c], acc[r][c]);
            }
        }
        for (int64_t r = 0; r < kScoreRows; r++)
            for (int64_t c = 0; c < kVecs; c++) store_vec(scores + r * padded + i + c * kLanes, acc[r][c]);
    }
}

// Softmax of one row of scores over its first `visible` keys, in place: probabilities rounded to
// bf16 (kept as fp32), zero up to `width`. Returns their fp32 sum (before rounding: 16 lane sums,
// then hsum's order, on any vector width) and sets *row_max.
float softmax_row(const Problem &p, float *scores, int64_t visible, int64_t width, float *row_max) {
    constexpr int64_t kVecs = 16 / kLanes;
    const int64_t full = visible / kLanes * kLanes;
    vec top = broadcast(-INFINITY);
    for (int64_t i = 0; i < full; i += kLanes) {
        const vec s = load_vec(scores + i);
        top = top > s ? top : s;
    }
    float m = -INFINITY;
    for (int64_t lane = 0; lane < kLanes; lane++) m = top[lane] > m ? top[lane] : m;
    for (int64_t i = full; i < visible; i++) m = scores[i] > m ? scores[i] : m;
    const vec max = broadcast(m), to_exp2 = broadcast(p.scale * 1.44269504088896341f);
    vec lane_index;
    for (int64_t lane = 0; lane < kLanes; lane++) lane_index[lane] = static_cast<float>(lane);
    vec sums[kVecs] = {};
    for (int64_t i = 0; i < width; i += 16) {
        for (int64_t c = 0; c < kVecs; c++) {
            const int64_t first = i + c * kLanes;
            vec e = exp2_nonpositive((load_vec(scores + first) - max) * to_exp2);
            if (first + kLanes > visible) e = lane_index < broadcast(static_cast<float>(visible - first)) ? e : vec{};
            sums[c] += e;
            store_vec(scores + first, round_to_bf16(e));
        }
    }
    *row_max = m;
    v16f sum;
    memcpy(&sum, sums, sizeof(sum));
    return hsum(sum);
}

// Output columns [d0, d0 + kLanes * C) of query rows [r0, r0 + kValueRows) (fp32, [kValueRows][D])
// = probabilities x values over keys [0, width), summed over keys in order. C is a constant so the
// accumulators stay in registers.
template <int64_t C>
void weigh_columns(const Problem &p, const float *probabilities, const float *values, int64_t width,
                   int64_t d0, float *out) {
    const int64_t padded = p.padded_length();
    vec acc[kValueRows][C] = {};
    for (int64_t i = 0; i < width; i++) {
        vec value[C];
        for (int64_t c = 0; c < C; c++) {
            const int64_t column = d0 + c * kLanes;  // in strip column / 16, at column % 16
            value[c] = load_vec(values + ((column / 16) * padded + i) * 16 + column % 16);
        }
        for (int64_t r = 0; r < kValueRows; r++) {
            const vec weight = broadcast(probabilities[r * padded + i]);
            for (int64_t c = 0; c < C; c++) acc[r][c] = fma_lanes(weight, value[c], acc[r][c]);
        }
    }
    for (int64_t r = 0; r < kValueRows; r++)
        for (int64_t c = 0; c < C; c++) store_vec(out + r * p.dim + d0 + c * kLanes, acc[r][c]);
}

void weigh_values(const Problem &p, const float *probabilities, const float *values, int64_t width,
                  float *out) {
    int64_t d0 = 0;
    for (; d0 + kTileCols <= p.dim; d0 += kTileCols)
        weigh_columns<kTileCols / kLanes>(p, probabilities, values, width, d0, out);
    for (; d0 < p.dim; d0 += 16) weigh_columns<16 / kLanes>(p, probabilities, values, width, d0, out);
}

// Query rows [kRows * block, +kRows) of head h: scores, softmax, product with V, out and lse.
void attend_rows(const Problem &p, int64_t h, int64_t block, const float *keys, const float *values,
                 float *queries, float *scores, float *weighed) {
    const int64_t padded = p.padded_length(), first = block * kRows;
    const int64_t count = std::min(kRows, p.rows() - first);
    // The keys some row of the block sees (causal: its last row sees the most), in whole 16s.
    const int64_t width = (p.visible(first + count - 1) + 15) / 16 * 16;
    for (int64_t r = 0; r < kRows; r++) {
        const int64_t row = first + r;
        float *dst = queries + r * p.dim;
        if (r < count) {
            const uint16_t *src = p.q + (row / p.group) * p.q_stride + (h * p.group + row % p.group) * p.dim;
            for (int64_t d = 0; d < p.dim; d++) dst[d] = to_float(src[d]);
        } else {
            memset(dst, 0, p.dim * 4);
        }
    }
    for (int64_t r = 0; r < kRows; r += kScoreRows)
        score_rows(p, queries + r * p.dim, keys, width, scores + r * padded);
    float sums[kRows], maxima[kRows];
    for (int64_t r = 0; r < kRows; r++) {
        if (r < count)
            sums[r] = softmax_row(p, scores + r * padded, p.visible(first + r), width, &maxima[r]);
        else
            memset(scores + r * padded, 0, width * 4);
    }
    for (int64_t r = 0; r < kRows; r += kValueRows)
        weigh_values(p, scores + r * padded, values, width, weighed + r * p.dim);
    for (int64_t r = 0; r < count; r++) {
        const int64_t row = first + r;
        uint16_t *dst = p.out + (row / p.group) * p.out_token + h * p.out_head + (row % p.group) * p.out_query;
        const v16f total = v16f{} + sums[r];  // divided: one rounding, not two of a * (1 / sum)
        for (int64_t d = 0; d < p.dim; d += 16) store16(dst + d, load16(weighed + r * p.dim + d) / total);
        if (p.lse) p.lse[h * p.rows() + row] = maxima[r] * p.scale + logf(sums[r]);
    }
}

void prefix_attention(const Problem &p) {
    const int64_t row_blocks = (p.rows() + kRows - 1) / kRows, key_blocks = p.padded_length() / 16;
    const int64_t per_head = p.padded_length() * p.dim;
    // Reused between calls of this thread; every element read is written first.
    static thread_local std::vector<float> packed;
    if (packed.size() < static_cast<size_t>(2 * p.kv_heads * per_head))
        packed.resize(2 * p.kv_heads * per_head);
    float *keys = packed.data(), *values = keys + p.kv_heads * per_head;
#pragma omp parallel
    {
        // Keys and values of every head, one list of tasks (one barrier).
        const int64_t tasks = p.kv_heads * key_blocks;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < 2 * tasks; task++) {
            const int64_t t = task % tasks, h = t / key_blocks, block = t % key_blocks;
            if (task < tasks)
                pack_keys(p, h, block, keys + h * per_head + block * 16 * p.dim);
            else
                pack_values(p, h, block, values + h * per_head);
        }
        static thread_local std::vector<float> scratch;
        const size_t needed = static_cast<size_t>(kRows * (2 * p.dim + p.padded_length()));
        if (scratch.size() < needed) scratch.resize(needed);
        float *queries = scratch.data(), *weighed = queries + kRows * p.dim, *scores = weighed + kRows * p.dim;
#pragma omp for schedule(static) nowait
        for (int64_t task = 0; task < p.kv_heads * row_blocks; task++) {
            const int64_t h = task / row_blocks;
            attend_rows(p, h, task % row_blocks, keys + h * per_head, values + h * per_head, queries, scores,
                        weighed);
        }
    }
}

}  // namespace

// The contract of amx_prefix_attention_bf16 (amx_attention.cpp) on any x86-64 CPU. 0 when done; 1
// for a shape it has no kernel for (head_dim not a multiple of 16, heads not a multiple of kv_heads).
extern "C" int prefix_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                     int64_t kv_stride, const int64_t *slots, uint16_t *out, int64_t out_token,
                                     float *lse, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim,
                                     int64_t length, float scale, int64_t causal_offset) {
    if (dim % 16 || dim <= 0 || kv_heads <= 0 || heads % kv_heads || length <= 0 || n <= 0) return 1;
    const int64_t group = heads / kv_heads;
    const int64_t token = out_token ? out_token : group * dim, head = out_token ? group * dim : n * group * dim;
    prefix_attention({q, q_stride, k, v, kv_stride, slots, out, token, head, dim, lse, n, kv_heads, group, dim,
                      length, scale, causal_offset});
    return 0;
}
