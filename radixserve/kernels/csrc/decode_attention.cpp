// Decode attention over the paged KV pool, loaded with cpu_kernels.cpp (radixserve/kernels/native.py).
//
// Why native: a decode query reads its whole context from the pool, where a request's K/V rows lie
// at the slots of its req_to_token row; this reads them in place (torch would gather them first)
// and computes the G query heads that share a K/V head together, so each row is read once a step.
// Its own file: its 68 compiled shapes make it the slowest part of the library to build, and the
// build compiles the files in parallel.
//
// Numerics: fp32 sums in one order per query, fixed by its context (and, with the batch-invariant
// pieces below, by nothing else). The dot products and P.V sums are explicit fused multiply-adds
// (fma_lanes), on any vector width, so no compiler contraction choice can make ISAs differ.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "vec16.h"

namespace {

using namespace radixserve_vec;

// ---- Decode attention over the paged KV pool -----------------------------------------------
// One query token per request; its context is the KV slots req_to_token[row][0 : len), or with a
// sliding window w its last w positions, [max(0, len - w), len) (transformers' convention). The G
// query heads that share a K/V head are computed together, so each K/V row is read once per step.
// Online softmax over blocks of kBlock tokens, in fp32, with exp2 on log2(e)-scaled scores.
// A small batch splits each context into pieces, merged at the end, so that every thread works.

constexpr int kBlock = 32;
constexpr int kPrefetch = 32;  // tokens ahead
constexpr int64_t kMinPieceTokens = 64;

// Batch-invariant mode (set_decode_fixed_pieces): when > 0, every context is cut into pieces of
// exactly this many positions counted from position 0, whatever else is in the batch and however
// many threads run, so a query's sums run in an order fixed by its own context length alone.
// 0: pieces sized from the batch so that every thread works (faster for small batches).
int64_t g_fixed_piece_tokens = 0;

// The K row of context position i, after asking for the K row kPrefetch positions ahead and for
// this position's V row (used once the block's scores are known): the pool is paged, so hardware
// prefetchers cannot guess the next slot.
template <typename T, int64_t D>
inline const T *key_row(const T *k_cache, const T *v_cache, const int64_t *slots, int64_t i, int64_t end,
                        int64_t kv_heads, int64_t head) {
    const int64_t row = (slots[i] * kv_heads + head) * D;
    if (i + kPrefetch < end) {
        const int64_t ahead = (slots[i + kPrefetch] * kv_heads + head) * D;
        for (int64_t line = 0; line < D * (int64_t)sizeof(T); line += 64) {
            __builtin_prefetch(reinterpret_cast<const char *>(k_cache + ahead) + line);
        }
    }
    for (int64_t line = 0; line < D * (int64_t)sizeof(T); line += 64) {
        __builtin_prefetch(reinterpret_cast<const char *>(v_cache + row) + line);
    }
    return k_cache + row;
}

#if defined(__AVX512F__)
// With AVX-512: 16-lane vectors, one zmm register each.

// G query rows of one K/V head and their dot products with key rows. fp32 in general; for bf16
// with AVX512-BF16, the queries stay bf16 and each instruction multiplies 32 pairs exactly and
// adds them in fp32, so keys need no conversion.
template <typename T, int G, int DV, bool kBf16Dot = false>
struct Queries {
    v16f rows[G][DV];
    float scale;
    void load(const T *q, float q_scale) {
        scale = q_scale;
        for (int g = 0; g < G; g++)
            for (int j = 0; j < DV; j++) rows[g][j] = load16(q + g * DV * 16 + 16 * j);
    }
    void scores(const T *key, float (*out)[kBlock], int t) const {
        v16f k[DV];
        for (int j = 0; j < DV; j++) k[j] = load16(key + 16 * j);
        for (int g = 0; g < G; g++) {
            // The first product as an fma onto +0 (the same bits as the product): a plain product
            // would let the compiler fuse it into the horizontal sum's first add where DV is 1, in
            // one build and not the other.
            v16f dot = fma_lanes(rows[g][0], k[0], v16f{});
            for (int j = 1; j < DV; j++) dot = fma_lanes(rows[g][j], k[j], dot);
            out[g][t] = hsum(dot) * scale;
        }
    }
};

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
template <int G, int DV>
struct Queries<uint16_t, G, DV, true> {
    static_assert(DV % 2 == 0, "32 bf16 per instruction");
    __m512bh rows[G][DV / 2];
    float scale;
    void load(const uint16_t *q, float q_scale) {
        scale = q_scale;
        for (int g = 0; g < G; g++)
            for (int j = 0; j < DV / 2; j++) rows[g][j] = (__m512bh)_mm512_loadu_si512(q + g * DV * 16 + 32 * j);
    }
    void scores(const uint16_t *key, float (*out)[kBlock], int t) const {
        __m512bh k[DV / 2];
        for (int j = 0; j < DV / 2; j++) k[j] = (__m512bh)_mm512_loadu_si512(key + 32 * j);
        for (int g = 0; g < G; g++) {
            __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), rows[g][0], k[0]);
            for (int j = 1; j < DV / 2; j++) dot = _mm512_dpbf16_ps(dot, rows[g][j], k[j]);
            out[g][t] = _mm512_reduce_add_ps(dot) * scale;
        }
    }
};
#else
constexpr bool kHaveBf16Dot = false;
#endif

// Unnormalized attention of G queries over context positions [begin, end): per query, the
// running max score (log2 units), the sum of 2^(score - max), and sum of 2^(score - max) * v.
template <typename T, int G, int DV>
void attend_range(const T *q, const T *k_cache, const T *v_cache, const int64_t *slots, int64_t begin,
                  int64_t end, int64_t kv_heads, int64_t head, float q_scale, float *max_out, float *sum_out,
                  float *acc_out) {
    constexpr int64_t D = DV * 16;
    Queries<T, G, DV, kHaveBf16Dot && sizeof(T) == 2 && DV % 2 == 0> queries;
    queries.load(q, q_scale);
    v16f acc[G][DV];
    float running_max[G], running_sum[G];
    for (int g = 0; g < G; g++) {
        for (int j = 0; j < DV; j++) acc[g][j] = v16f{};
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    float scores[G][kBlock] __attribute__((aligned(64)));
    for (int64_t start = begin; start < end; start += kBlock) {
        const int n = end - start < kBlock ? static_cast<int>(end - start) : kBlock;
        for (int t = 0; t < n; t++) {
            const T *key = key_row<T, D>(k_cache, v_cache, slots, start + t, end, kv_heads, head);
            queries.scores(key, scores, t);
        }
        for (int g = 0; g < G; g++) {
            float block_max = running_max[g];
            for (int t = 0; t < n; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            const float rescale = exp2f(running_max[g] - block_max);
            running_max[g] = block_max;
            running_sum[g] *= rescale;
            for (int j = 0; j < DV; j++) acc[g][j] *= rescale;
            for (int t = n; t < kBlock; t++) scores[g][t] = -INFINITY;
            v16f total = v16f{};
            for (int t = 0; t < kBlock; t += 16) {
                const v16f p = exp2_nonpositive(load16(&scores[g][t]) - block_max);
                store16(&scores[g][t], p);
                total += p;
            }
            running_sum[g] += hsum(total);
        }
        for (int t = 0; t < n; t++) {
            const T *value = v_cache + (slots[start + t] * kv_heads + head) * D;
            v16f v[DV];
            for (int j = 0; j < DV; j++) v[j] = load16(value + 16 * j);
            for (int g = 0; g < G; g++) {
                const float p = scores[g][t];
                for (int j = 0; j < DV; j++) acc[g][j] = fma_lanes(v16f{} + p, v[j], acc[g][j]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        max_out[g] = running_max[g];
        sum_out[g] = running_sum[g];
        for (int j = 0; j < DV; j++) store16(acc_out + g * D + 16 * j, acc[g][j]);
    }
}

#else  // no AVX-512

// The same arithmetic lane for lane on 8-lane vectors: with 16-lane ones GCC spills the queries and
// sums, and splits each scalar broadcast into stores, when 64-byte registers are absent. A 16-lane
// value v is the pair (v[0:8], v[8:16]) here; every sum runs in the order of the code above, so
// both give the same bits (on an AVX-512 CPU, tests/kernels/test_native_isa.py compares this build's
// with the native one).
template <typename T, int G, int DV>
void attend_range(const T *q, const T *k_cache, const T *v_cache, const int64_t *slots, int64_t begin,
                  int64_t end, int64_t kv_heads, int64_t head, float q_scale, float *max_out, float *sum_out,
                  float *acc_out) {
    constexpr int64_t D = DV * 16;
    constexpr int H = 2 * DV;  // 8-lane vectors per row
    // Widened once; read back from L1 for every key, as they would not fit in the registers.
    float query[G][D] __attribute__((aligned(32)));
    for (int g = 0; g < G; g++)
        for (int h = 0; h < H; h++) {
            const v8f x = load8(q + g * D + 8 * h);
            memcpy(&query[g][8 * h], &x, 32);
        }
    float acc[G][D] __attribute__((aligned(32))) = {};
    float running_max[G], running_sum[G];
    for (int g = 0; g < G; g++) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    float scores[G][kBlock] __attribute__((aligned(64)));
    for (int64_t start = begin; start < end; start += kBlock) {
        const int n = end - start < kBlock ? static_cast<int>(end - start) : kBlock;
        for (int t = 0; t < n; t++) {
            const T *key = key_row<T, D>(k_cache, v_cache, slots, start + t, end, kv_heads, head);
            v8f k[H];
            for (int h = 0; h < H; h++) k[h] = load8(key + 8 * h);
            for (int g = 0; g < G; g++) {
                const float *row = query[g];
                // As fmas onto +0, as in the AVX-512 build: with DV 1, plain products here were fused
                // into hsum's first add (lo + hi), which changed the scores' last bit.
                v8f lo = fma_lanes(load8(row), k[0], v8f{}), hi = fma_lanes(load8(row + 8), k[1], v8f{});
                for (int j = 1; j < DV; j++) {
                    lo = fma_lanes(load8(row + 16 * j), k[2 * j], lo);
                    hi = fma_lanes(load8(row + 16 * j + 8), k[2 * j + 1], hi);
                }
                scores[g][t] = hsum(lo, hi) * q_scale;
            }
        }
        for (int g = 0; g < G; g++) {
            float block_max = running_max[g];
            for (int t = 0; t < n; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            const float rescale = exp2f(running_max[g] - block_max);
            running_max[g] = block_max;
            running_sum[g] *= rescale;
            for (int t = n; t < kBlock; t++) scores[g][t] = -INFINITY;
            v8f total_lo = v8f{}, total_hi = v8f{};
            for (int t = 0; t < kBlock; t += 16) {
                const v8f p_lo = exp2_nonpositive(load8(&scores[g][t]) - block_max);
                const v8f p_hi = exp2_nonpositive(load8(&scores[g][t + 8]) - block_max);
                memcpy(&scores[g][t], &p_lo, 32);
                memcpy(&scores[g][t + 8], &p_hi, 32);
                total_lo += p_lo;
                total_hi += p_hi;
            }
            running_sum[g] += hsum(total_lo, total_hi);
            // Each query's sums stay in registers over the block; the block's V rows come from L1.
            v8f sums[H];
            for (int h = 0; h < H; h++) sums[h] = load8(&acc[g][8 * h]) * rescale;
            for (int t = 0; t < n; t++) {
                const T *value = v_cache + (slots[start + t] * kv_heads + head) * D;
                const float p = scores[g][t];
                for (int h = 0; h < H; h++) sums[h] = fma_lanes(v8f{} + p, load8(value + 8 * h), sums[h]);
            }
            for (int h = 0; h < H; h++) memcpy(&acc[g][8 * h], &sums[h], 32);
        }
    }
    for (int g = 0; g < G; g++) {
        max_out[g] = running_max[g];
        sum_out[g] = running_sum[g];
        memcpy(acc_out + g * D, acc[g], D * sizeof(float));
    }
}

#endif  // AVX-512

// Attention over a prefix that every request of the batch shares, computed beforehand (by a
// batched GEMM-shaped call, which reads the prefix once for all requests): its normalized output
// and natural-log log-sum-exp per (K/V head, request * G + query head in group).
template <typename T>
struct SharedPrefix {
    int64_t length;  // context positions [0, length) of every request; 0: no shared prefix
    const T *out;    // row (head, b * G + g) at out + head * head_stride + (b * G + g) * row_stride
    int64_t head_stride, row_stride;
    const float *lse;  // [kv_heads, batch * G]
};

template <typename T, int G, int DV>
void decode_attention(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,
                      const int64_t *req_to_token, int64_t table_stride, const int64_t *req_rows,
                      const int64_t *lens, T *out, int64_t batch, int64_t kv_heads, float scale,
                      SharedPrefix<T> prefix, int64_t window) {
    constexpr int64_t D = DV * 16;
    // The first position request b attends after the shared prefix: its window's start (no window
    // comes with a shared prefix).
    const auto first = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; };
    const int64_t heads = kv_heads * G;
    const float q_scale = scale * 1.4426950408889634f;  // log2(e): softmax through exp2
    const int64_t items = batch * kv_heads;
    const int64_t wanted = 4 * static_cast<int64_t>(omp_get_max_threads());
    const int64_t fixed = g_fixed_piece_tokens;
    int64_t pieces = items >= wanted ? 1 : (wanted + items - 1) / items;
    if (fixed > 0) {
        // Enough pieces for the longest context; shorter ones leave their last pieces empty.
        int64_t longest = 1;
        for (int64_t b = 0; b < batch; b++) longest = std::max(longest, lens[b] - prefix.length - first(b));
        pieces = (longest + fixed - 1) / fixed;
    }
    // Per (request, K/V head, piece) and query: max, sum, then D accumulated values.
    constexpr int64_t kStride = 2 + D;
    std::vector<float> partial(static_cast<size_t>(items * pieces * G * kStride));
    // Whole requests per grab when unsplit: a request's K/V rows then stay in one core's cache
    // while its K/V heads are read one after another.
    const int64_t chunk = pieces == 1 ? kv_heads : 1;
#pragma omp parallel for schedule(dynamic, chunk)
    for (int64_t work = 0; work < items * pieces; work++) {
        const int64_t item = work / pieces, piece = work % pieces;
        const int64_t b = item / kv_heads, head = item % kv_heads;
        const int64_t skip = prefix.length + first(b), len = lens[b] - skip;
        const int64_t step = fixed > 0 ? fixed : std::max(kMinPieceTokens, (len + pieces - 1) / pieces);
        const int64_t begin = std::min(len, piece * step), end = std::min(len, begin + step);
        float *slot = partial.data() + work * G * kStride;
        float max_out[G], sum_out[G];
        attend_range<T, G, DV>(q + b * q_stride + head * G * D, k_cache, v_cache,
                               req_to_token + req_rows[b] * table_stride + skip, begin, end, kv_heads,
                               head, q_scale, max_out, sum_out, slot + 2 * G);
        for (int g = 0; g < G; g++) {
            slot[g] = max_out[g];
            slot[G + g] = sum_out[g];
        }
    }
    // Merge the pieces (and the shared prefix's result): each weighted by 2^(its max - the top).
#pragma omp parallel for if (items * G * D >= kParallelMin)
    for (int64_t item = 0; item < items; item++) {
        const int64_t b = item / kv_heads, head = item % kv_heads;
        const float *first = partial.data() + item * pieces * G * kStride;
        for (int g = 0; g < G; g++) {
            // The prefix's normalized output stands for an exp-sum of e^lse = 2^(lse * log2(e)).
            const int64_t row = b * G + g;
            const float prefix_max =
                prefix.length ? prefix.lse[head * batch * G + row] * 1.4426950408889634f : -INFINITY;
            float top = prefix_max;
            for (int64_t p = 0; p < pieces; p++) top = std::max(top, first[p * G * kStride + g]);
            float total = 0.0f;
            v16f acc[DV] = {};
            if (prefix.length) {
                const float weight = exp2f(prefix_max - top);
                const T *shared = prefix.out + head * prefix.head_stride + row * prefix.row_stride;
                total = weight;
                for (int j = 0; j < DV; j++) acc[j] = load16(shared + 16 * j) * weight;
            }
            for (int64_t p = 0; p < pieces; p++) {
                const float *slot = first + p * G * kStride;
                if (slot[G + g] == 0.0f) continue;  // an empty piece
                const float weight = exp2f(slot[g] - top);
                total += slot[G + g] * weight;
                for (int j = 0; j < DV; j++) acc[j] += load16(slot + 2 * G + g * D + 16 * j) * weight;
            }
            T *dst = out + (b * heads + head * G + g) * D;
            for (int j = 0; j < DV; j++) store16(dst + 16 * j, acc[j] / total);
        }
    }
}

template <typename T>
using DecodeKernel = void (*)(const T *, int64_t, const T *, const T *, const int64_t *, int64_t, const int64_t *,
                              const int64_t *, T *, int64_t, int64_t, float, SharedPrefix<T>, int64_t);

// The compiled (query heads per K/V head, head_dim) shapes; nullptr for any other.
template <typename T>
DecodeKernel<T> find_decode_kernel(int64_t group, int64_t head_dim) {
#define RADIXSERVE_CASE(G, DV) \
    if (group == G && head_dim == DV * 16) return decode_attention<T, G, DV>;
#define RADIXSERVE_GROUPS(DV)                                                                   \
    RADIXSERVE_CASE(1, DV) RADIXSERVE_CASE(2, DV) RADIXSERVE_CASE(3, DV) RADIXSERVE_CASE(4, DV) \
    RADIXSERVE_CASE(5, DV) RADIXSERVE_CASE(6, DV) RADIXSERVE_CASE(7, DV) RADIXSERVE_CASE(8, DV)
    // head_dim 16 and 32 are the tiny test models'; 64 and 128 are nearly every served model's; 256
    // with 2 or 4 query heads per K/V head is Gemma 3's (270M and 1B: 4; 4B to 27B: 2).
    RADIXSERVE_GROUPS(1) RADIXSERVE_GROUPS(2) RADIXSERVE_GROUPS(4) RADIXSERVE_GROUPS(8)
    RADIXSERVE_CASE(2, 16) RADIXSERVE_CASE(4, 16)
#undef RADIXSERVE_GROUPS
#undef RADIXSERVE_CASE
    return nullptr;
}

template <typename T>
int decode_attention_dispatch(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,
                              const int64_t *req_to_token, int64_t table_stride, const int64_t *req_rows,
                              const int64_t *lens, T *out, int64_t batch, int64_t heads, int64_t kv_heads,
                              int64_t head_dim, float scale, SharedPrefix<T> prefix, int64_t window) {
    if (kv_heads <= 0 || heads % kv_heads) return 1;
    if (window > 0 && prefix.length) return 4;  // a shared prefix may lie partly outside a window
    const DecodeKernel<T> kernel = find_decode_kernel<T>(heads / kv_heads, head_dim);
    if (kernel == nullptr) return 2;  // the caller uses torch
    for (int64_t b = 0; b < batch; b++) {
        if (lens[b] <= prefix.length) return 3;  // every request needs a token of its own
    }
    kernel(q, q_stride, k_cache, v_cache, req_to_token, table_stride, req_rows, lens, out, batch, kv_heads, scale,
           prefix, window);
    return 0;
}

}  // namespace

// ---- C ABI ("bf16": torch.bfloat16, "f32": torch.float32) ------------------------------------

#define RADIXSERVE_EXPORT_DECODE(T, SUFFIX)                                                             \
    extern "C" int decode_attention_##SUFFIX(                                                           \
        const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int64_t *req_to_token,    \
        int64_t table_stride, const int64_t *req_rows, const int64_t *lens, T *out, int64_t batch,        \
        int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t prefix_length,            \
        const T *prefix_out, int64_t prefix_head_stride, int64_t prefix_row_stride,                       \
        const float *prefix_lse, int64_t window) {                                                         \
        const SharedPrefix<T> prefix{prefix_length, prefix_out, prefix_head_stride, prefix_row_stride,    \
                                     prefix_lse};                                                          \
        return decode_attention_dispatch<T>(q, q_stride, k_cache, v_cache, req_to_token, table_stride,   \
                                            req_rows, lens, out, batch, heads, kv_heads, head_dim, scale, \
                                            prefix, window);                                              \
    }

RADIXSERVE_EXPORT_DECODE(uint16_t, bf16)
RADIXSERVE_EXPORT_DECODE(float, f32)

extern "C" void set_decode_fixed_pieces(int64_t tokens) { g_fixed_piece_tokens = tokens > 0 ? tokens : 0; }

extern "C" int decode_attention_supported(int64_t group, int64_t head_dim) {
    return find_decode_kernel<float>(group, head_dim) != nullptr;
}
