// Native CPU kernels of radixserve, loaded through ctypes (radixserve/kernels/native.py).
//
// Why native: on a CPU, a decode step of a small model is dominated by memory traffic and by the
// per-op cost of many small torch calls. These kernels fuse what torch runs as several passes
// (RMSNorm, SiLU·mul, rotary) and read paged K/V in place for decode attention.
//
// Numerics: the elementwise kernels round exactly where the torch reference does (an fp32
// computation rounded to the model dtype after every op the reference runs in that dtype), so they
// match torch bit for bit (RMSNorm even adds its sum of squares in torch's order: see there) except
// where SiLU's exp differs from torch's in the last fp32 bit. They are compiled with fp contraction
// off for that reason: a fused multiply-add rounds once where the reference rounds twice.
//
// Threads: OpenMP, linked against the libgomp torch itself loads, so both share one thread pool.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "amx_common.h"
#include "vec16.h"

namespace {

using namespace radixserve_vec;

// ---- RMSNorm -------------------------------------------------------------------------------
// Reference: y = x.float() * rsqrt(mean(x.float()^2) + eps); out = weight * y.to(T).
//
// The sum of squares is added in exactly the order torch's CPU sum adds a contiguous fp32 row
// (aten/src/ATen/native/cpu/SumKernel.cpp: cascade_sum -> vectorized_inner_sum -> row_sum ->
// multi_row_sum), so that the kernel is bit for bit the reference. Any other order (this kernel
// once summed 16 lanes and reduced them as a tree) moves the fp32 mean by an ulp now and then,
// and where the normalized values sit within an ulp of a bf16 rounding midpoint that flips them
// (real bf16 activations have few distinct mantissas, so a whole row's worth flips together).
// That alone took SmolLM2-135M's first-step bf16 logits from 0.108 to 0.145 mean |error| against
// fp32 (tests/engine/test_smollm2_gguf.py): a few flips in one early row of the shared system
// prompt, whose K/V every later prompt reuses. torch adds 8-lane vectors on every x86-64 CPU (it
// registers no AVX-512 sum kernel, so AVX-512 CPUs run the AVX2 one, and its default build's
// vectors are 8 floats too: checked with ATEN_CPU_CAPABILITY=avx512, avx2 and default), so the
// order depends neither on the CPU nor on the ISA these kernels are built for.

constexpr int64_t kTorchSumLanes = 8;
constexpr int kTorchSumIlp = 4;     // row_sum's ilp_factor
constexpr int kTorchSumLevels = 4;  // multi_row_sum's num_levels

inline int64_t torch_ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x) - 1); }

// The squares of vector or scalar `index` of a row: what torch's pow(x, 2) holds.
template <typename T>
struct SquaredVectors {
    const T *row;
    v8f operator()(int64_t index) const {
        const v8f v = load8(row + index * kTorchSumLanes);
        return v * v;
    }
};
template <typename T>
struct SquaredScalars {
    const T *row;
    float operator()(int64_t index) const {
        const float v = to_float(row[index]);
        return v * v;
    }
};

// multi_row_sum with nrows = kTorchSumIlp over `size` groups of kTorchSumIlp consecutive items,
// then row_sum's leftover items and its sequential combination of the kTorchSumIlp partial sums.
template <typename V, typename Load>
__attribute__((optimize("fp-contract=off"))) V torch_row_sum(Load load, int64_t count) {
    const int64_t size = count / kTorchSumIlp;
    const int64_t level_power = std::max<int64_t>(4, torch_ceil_log2(size) / kTorchSumLevels);
    const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
    V acc[kTorchSumLevels][kTorchSumIlp];
    for (auto &level : acc)
        for (V &a : level) a = V{};
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < kTorchSumIlp; k++) acc[0][k] += load(i * kTorchSumIlp + k);
        for (int j = 1; j < kTorchSumLevels; j++) {
            for (int k = 0; k < kTorchSumIlp; k++) {
                acc[j][k] += acc[j - 1][k];
                acc[j - 1][k] = V{};
            }
            if (i & (level_mask << (j * level_power))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < kTorchSumIlp; k++) acc[0][k] += load(i * kTorchSumIlp + k);
    for (int j = 1; j < kTorchSumLevels; j++)
        for (int k = 0; k < kTorchSumIlp; k++) acc[0][k] += acc[j][k];
    V total = acc[0][0];
    for (int64_t item = size * kTorchSumIlp; item < count; item++) total += load(item);
    for (int k = 1; k < kTorchSumIlp; k++) total += acc[0][k];
    return total;
}

// torch's x.float().pow(2).sum(-1) of one contiguous row, bit for bit: vectorized_inner_sum when
// the row holds a vector (the leftover elements first, then the lanes in order), else row_sum on
// scalars.
template <typename T>
__attribute__((optimize("fp-contract=off"))) float torch_sum_of_squares(const T *row, int64_t size) {
    if (size < kTorchSumLanes) return torch_row_sum<float>(SquaredScalars<T>{row}, size);
    const int64_t vectors = size / kTorchSumLanes;
    const v8f lanes = torch_row_sum<v8f>(SquaredVectors<T>{row}, vectors);
    float total = 0.0f;
    for (int64_t i = vectors * kTorchSumLanes; i < size; i++) {
        const float v = to_float(row[i]);
        total += v * v;
    }
    for (int k = 0; k < kTorchSumLanes; k++) total += lanes[k];
    return total;
}

//
// unit_offset (Gemma's RMSNorm): out = (y * (1 + weight.float())).to(T), the scale in fp32 and
// rounded once, as Gemma's reference scales.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rms_norm(const T *x, int64_t x_stride, const T *weight,
                                                           T *out, int64_t rows, int64_t size, float eps,
                                                           bool unit_offset) {
#pragma omp parallel for if (rows * size >= kParallelMin)
    for (int64_t r = 0; r < rows; r++) {
        const T *row = x + r * x_stride;
        T *dst = out + r * size;
        // mean = sum / size, + eps, then rsqrt as 1 / sqrt: torch's div_, add_ and rsqrt, in fp32.
        const float inv = 1.0f / sqrtf(torch_sum_of_squares(row, size) / static_cast<float>(size) + eps);
        for (int64_t i = 0; i < size; i += kLanes) {
            const vec y = load_n(row + i, size - i) * inv;
            if (unit_offset)
                store_n(dst + i, y * (load_n(weight + i, size - i) + 1.0f), size - i);
            else
                store_n(dst + i, load_n(weight + i, size - i) * as_dtype(y, dst), size - i);
        }
    }
}

// ---- SiLU(gate) * up, GELU-tanh(gate) * up ---------------------------------------------------
// Reference: silu(gate) = gate / (1 + exp(-gate)) in T, then times up in T. x: [rows, 2 * size].

//
// gelu_tanh_and_mul: GELU's tanh approximation in place of SiLU (Gemma), gelu(g) = g * (1 + tanh(u)) / 2
// with u = sqrt(2 / pi) * (g + 0.044715 g^3), computed as g / (1 + exp(-2u)): the same function
// without tanh's cancellation near 0. Within a few fp32 ulps of torch's, not bit for bit.

enum class Gate { kSilu, kGeluTanh };

template <Gate kGate, typename T>
__attribute__((optimize("fp-contract=off"))) void gated_mul(const T *x, int64_t x_stride, T *out, int64_t rows,
                                                            int64_t size) {
    constexpr float kTwoSqrtTwoOverPi = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
#pragma omp parallel for if (rows * size >= kParallelMin)
    for (int64_t r = 0; r < rows; r++) {
        const T *gate = x + r * x_stride;
        const T *up = gate + size;
        T *dst = out + r * size;
        for (int64_t i = 0; i < size; i += kLanes) {
            const vec g = load_n(gate + i, size - i);
            vec exponent = vec{} - g;
            if constexpr (kGate == Gate::kGeluTanh)
                exponent = vec{} - (g + g * g * g * 0.044715f) * kTwoSqrtTwoOverPi;
            const vec activated = as_dtype(g / (1.0f + exp_lanes(exponent)), dst);
            store_n(dst + i, activated * load_n(up + i, size - i), size - i);
        }
    }
}

// ---- Rotary embedding, half-split ("neox") layout, in place --------------------------------
// Reference, all in T: (x1, x2) -> (x1*cos + x2*(-sin), x2*cos + x1*sin), with cos and sin
// rounded to T first. x: [rows, heads, dim] rows apart by x_stride; tables: [positions,
// rotary_dim / 2]. A partial rotary factor (rotary_dim < dim) turns each head's first rotary_dim
// dimensions (x1, x2 their halves) and leaves the rest.

template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotary(T *x, int64_t x_stride, int64_t rows, int64_t heads,
                                                         int64_t dim, int64_t rotary_dim, const float *cos_table,
                                                         const float *sin_table, const int64_t *positions) {
    const int64_t half = rotary_dim / 2;
#pragma omp parallel for if (rows * heads * dim >= kParallelMin)
    for (int64_t r = 0; r < rows; r++) {
        const float *cos_row = cos_table + positions[r] * half;
        const float *sin_row = sin_table + positions[r] * half;
        for (int64_t i = 0; i < half; i += kLanes) {
            const int64_t n = half - i;
            const vec c = as_dtype(load_n(cos_row + i, n), x), s = as_dtype(load_n(sin_row + i, n), x);
            const vec minus_s = vec{} - s;
            for (int64_t h = 0; h < heads; h++) {
                T *head = x + r * x_stride + h * dim;
                const vec x1 = load_n(head + i, n), x2 = load_n(head + half + i, n);
                const vec first = as_dtype(x1 * c, x) + as_dtype(x2 * minus_s, x);
                const vec second = as_dtype(x2 * c, x) + as_dtype(x1 * s, x);
                store_n(head + i, first, n);
                store_n(head + half + i, second, n);
            }
        }
    }
}

// ---- Merge of two attention results over disjoint key sets ----------------------------------
// out = (a * e^(lse_a - m) + b * e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m)), m = max(lse_a, lse_b),
// in fp32, rounded once. a, b: [N, A, B, D] with any strides but a contiguous last dimension;
// lse_a, lse_b: [N, A, B] fp32 with any strides; out: [N, A, B, D] contiguous.

struct Strides3 {
    int64_t n, a, b;
    int64_t at(int64_t i, int64_t j, int64_t k) const { return i * n + j * a + k * b; }
};

template <typename T>
void merge_by_lse(const T *out_a, Strides3 sa, const float *lse_a, Strides3 la, const T *out_b, Strides3 sb,
                  const float *lse_b, Strides3 lb, T *out, int64_t n, int64_t na, int64_t nb, int64_t dim) {
#pragma omp parallel for if (n * na * nb * dim >= kParallelMin)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t j = 0; j < na; j++) {
            for (int64_t k = 0; k < nb; k++) {
                const float x = lse_a[la.at(i, j, k)], y = lse_b[lb.at(i, j, k)];
                const float top = std::max(x, y);
                const float wa = expf(x - top), wb = expf(y - top), total = wa + wb;
                const T *a = out_a + sa.at(i, j, k), *b = out_b + sb.at(i, j, k);
                T *dst = out + ((i * na + j) * nb + k) * dim;
                for (int64_t d = 0; d < dim; d += kLanes) {
                    const vec merged = (load_n(a + d, dim - d) * wa + load_n(b + d, dim - d) * wb) / total;
                    store_n(dst + d, merged, dim - d);
                }
            }
        }
    }
}

}  // namespace

// ---- C ABI: one entry per kernel and dtype ("bf16": torch.bfloat16, "f32": torch.float32) -----

#define RADIXSERVE_EXPORT(T, SUFFIX)                                                                     \
    extern "C" void rms_norm_##SUFFIX(const T *x, int64_t x_stride, const T *weight, T *out, int64_t rows, \
                                       int64_t size, float eps, int64_t unit_offset) {                    \
        rms_norm<T>(x, x_stride, weight, out, rows, size, eps, unit_offset != 0);                         \
    }                                                                                                     \
    extern "C" void silu_and_mul_##SUFFIX(const T *x, int64_t x_stride, T *out, int64_t rows, int64_t size) { \
        gated_mul<Gate::kSilu, T>(x, x_stride, out, rows, size);                                          \
    }                                                                                                     \
    extern "C" void gelu_tanh_and_mul_##SUFFIX(const T *x, int64_t x_stride, T *out, int64_t rows,         \
                                                int64_t size) {                                           \
        gated_mul<Gate::kGeluTanh, T>(x, x_stride, out, rows, size);                                      \
    }                                                                                                     \
    extern "C" void rotary_##SUFFIX(T *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t dim,      \
                                     int64_t rotary_dim, const float *cos_table, const float *sin_table,  \
                                     const int64_t *positions) {                                          \
        rotary<T>(x, x_stride, rows, heads, dim, rotary_dim, cos_table, sin_table, positions);            \
    }

RADIXSERVE_EXPORT(uint16_t, bf16)
RADIXSERVE_EXPORT(float, f32)

#define RADIXSERVE_EXPORT_MERGE(T, SUFFIX)                                                               \
    extern "C" void merge_by_lse_##SUFFIX(                                                                 \
        const T *out_a, int64_t sa0, int64_t sa1, int64_t sa2, const float *lse_a, int64_t la0, int64_t la1, \
        int64_t la2, const T *out_b, int64_t sb0, int64_t sb1, int64_t sb2, const float *lse_b, int64_t lb0, \
        int64_t lb1, int64_t lb2, T *out, int64_t n, int64_t na, int64_t nb, int64_t dim) {                \
        merge_by_lse<T>(out_a, {sa0, sa1, sa2}, lse_a, {la0, la1, la2}, out_b, {sb0, sb1, sb2}, lse_b,      \
                        {lb0, lb1, lb2}, out, n, na, nb, dim);                                              \
    }
RADIXSERVE_EXPORT_MERGE(uint16_t, bf16)
RADIXSERVE_EXPORT_MERGE(float, f32)

// ---- Greedy choice: the first index of each row's maximum ------------------------------------
// As torch's max(dim).indices: the first maximal element, and a NaN counts as the maximum (the
// first NaN wins). x: [rows, cols] fp32, rows x_stride apart.

extern "C" void argmax_rows_f32(const float *x, int64_t x_stride, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for if (rows * cols >= kParallelMin)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        v16f best = v16f{} - INFINITY;
        v16i best_index = v16i{} - 1;
        const v16i lanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        v16i any_nan = v16i{};
        int64_t i = 0;
        for (; i + 16 <= cols; i += 16) {
            const v16f v = load16(row + i);
            const v16i greater = v > best;  // strict: a lane keeps its first maximum
            best = greater ? v : best;
            best_index = greater ? lanes + static_cast<int>(i) : best_index;
            any_nan |= v != v;
        }
        // Lanes that never beat -inf hold index -1; element 0 is the answer until something beats it.
        int64_t index = 0;
        float top = cols > 0 ? row[0] : 0.0f;
        for (int lane = 0; lane < 16; lane++) {
            if (best_index[lane] < 0) continue;
            if (best[lane] > top || (best[lane] == top && best_index[lane] < index)) {
                top = best[lane];
                index = best_index[lane];
            }
        }
        bool nan = false;
        for (int lane = 0; lane < 16; lane++) nan = nan || any_nan[lane];
        for (; i < cols; i++) {
            if (row[i] != row[i]) nan = true;
            if (row[i] > top) {
                top = row[i];
                index = i;
            }
        }
        if (nan) {
            for (int64_t j = 0; j < cols; j++) {
                if (row[j] != row[j]) {
                    index = j;
                    break;
                }
            }
        }
        out[r] = index;
    }
}

// What the compiler targeted (RADIXSERVE_CPU_ISA in native.py picks the flags): a bit each for
// AVX2 and FMA (1), AVX-512 F/BW/DQ/VL (2), AVX512-BF16 (4), and the AMX kernels (8).
extern "C" int compiled_isa() {
    int isa = 0;
#if defined(__AVX2__) && defined(__FMA__)
    isa |= 1;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
    isa |= 2;
#endif
#if defined(__AVX512BF16__)
    isa |= 4;
#endif
#if defined(RADIXSERVE_AMX)
    isa |= 8;
#endif
    return isa;
}
