// fp32 matmul for a few rows (decode steps), loaded with cpu_kernels.cpp.
//
// Why native: a decode step multiplies a few rows by every weight of the model, so its linears are
// bound by how fast the weights stream from memory. torch's fp32 F.linear (MKL) streamed weights
// that do not fit in the caches far below the machine's read bandwidth on an AVX2 CPU
// (docs/architecture.md, "fp32 linears"). Here each thread reads its share of W's rows once,
// sequentially, and computes every row of x against each W row while that row is in L1.
//
// Weight layout: torch's own, W [n, k] row-major, so nothing is packed or copied.
//
// Numerics: every output element is one dot product summed in a fixed order, the same for every row
// count, thread count and call: four 8-lane FMA accumulators over k in steps of 32 (accumulator a
// takes k = 32 i + 8 a + lane), then one over the remaining multiples of 8, added as
// hsum(a0 + a1, a2 + a3) (vec16.h), then the last k % 8 products in order, then the bias.

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

namespace {

using radixserve_vec::fma8;
using radixserve_vec::hsum;
using radixserve_vec::load8;
using radixserve_vec::v8f;

// How far ahead of its loads a thread fetches its stream of W (the rows it reads are consecutive, so
// this runs on into the next rows).
constexpr int64_t kPrefetchFloats = 2048;

inline float dot(const float *x, const float *w, int64_t k) {
    v8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        __builtin_prefetch(w + i + kPrefetchFloats);
        __builtin_prefetch(w + i + kPrefetchFloats + 16);
        a0 = fma8(load8(x + i), load8(w + i), a0);
        a1 = fma8(load8(x + i + 8), load8(w + i + 8), a1);
        a2 = fma8(load8(x + i + 16), load8(w + i + 16), a2);
        a3 = fma8(load8(x + i + 24), load8(w + i + 24), a3);
    }
    for (; i + 8 <= k; i += 8) a0 = fma8(load8(x + i), load8(w + i), a0);
    float sum = hsum(a0 + a1, a2 + a3);
    for (; i < k; ++i) sum = __builtin_fmaf(x[i], w[i], sum);
    return sum;
}

}  // namespace

// out [m, n] (rows out_stride apart) = x [m, k] (rows x_stride apart) W^T (+ bias [n]) for W [n, k]
// row-major; bias may be null.
extern "C" void fp32_linear(const float *x, int64_t x_stride, const float *w, float *out, int64_t out_stride,
                            const float *bias, int64_t m, int64_t n, int64_t k) {
    if (m <= 0 || n <= 0) return;
    const bool parallel = m * n * k >= radixserve_vec::kParallelMin;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t col = 0; col < n; ++col) {
        const float *row = w + col * k;
        const float b = bias ? bias[col] : 0.0f;
        for (int64_t r = 0; r < m; ++r) out[r * out_stride + col] = dot(x + r * x_stride, row, k) + b;
    }
}
