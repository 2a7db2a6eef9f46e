// 16-lane fp32 vector helpers shared by the native kernels: loads and stores with bf16 <-> fp32
// conversion, horizontal sums, exp and exp2. GCC vector extensions, so they compile to AVX-512 on
// such CPUs and to narrower code elsewhere.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

namespace radixserve_vec {

// Elementwise work below this many elements runs on one thread: waking the OpenMP pool costs more.
constexpr int64_t kParallelMin = 1 << 15;

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// ---- loads and stores of 16 lanes, bf16 <-> fp32 ------------------------------------------

inline v16f load16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, 32);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    memcpy(&f, &u, 64);
    return f;
}
inline v16f load16(const float *p) {
    v16f f;
    memcpy(&f, p, 64);
    return f;
}
inline void store16(float *p, v16f x) { memcpy(p, &x, 64); }
// 8 lanes and scalars, for code that must add in the order of torch's 8-lane CPU kernels.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
// x rounded to bf16 (nearest, ties to even; a NaN stays a NaN), as torch's .to() rounds.
inline uint16_t float_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline v8f load8(const float *p) {
    v8f f;
    memcpy(&f, p, 32);
    return f;
}
inline v8f load8(const uint16_t *p) {
    typedef uint16_t v8h __attribute__((vector_size(16)));
    typedef uint32_t v8u __attribute__((vector_size(32)));
    v8h h;
    memcpy(&h, p, 16);
    const v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, 32);
    return f;
}

// Round to nearest even, NaN kept NaN: what torch's float -> bfloat16 conversion does.
inline void store16(uint16_t *p, v16f x) {
    v16u u;
    memcpy(&u, &x, 64);
    v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v16u nan = (u >> 16) | 0x40u;
    v16u out = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
    v16h h = __builtin_convertvector(out, v16h);
    memcpy(p, &h, 32);
}

// The sum of a 16-lane vector held as its two halves, (lo, hi): the order hsum(v16f) adds in.
inline float hsum(v8f lo, v8f hi) {
    const v8f a = lo + hi;
    const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}
inline float hsum(v16f v) {
    return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

// ---- 8 lanes: one AVX2 register. GCC splits 64-byte vectors poorly without AVX-512 (a broadcast
// becomes 16 scalar stores, a lane access spills), so hot loops there run on v8f with these. Each
// gives every lane exactly the bits of its 16-lane twin.

typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f fma8(const v8f &a, const v8f &b, const v8f &c) {
#if defined(__FMA__)
    __m256 out = _mm256_fmadd_ps(reinterpret_cast<const __m256 &>(a), reinterpret_cast<const __m256 &>(b),
                                 reinterpret_cast<const __m256 &>(c));
    return reinterpret_cast<v8f &>(out);
#else
    return a * b + c;
#endif
}

inline v8f floor8(v8f x) {
#if defined(__AVX__)
    __m256 out = _mm256_round_ps(reinterpret_cast<__m256 &>(x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return reinterpret_cast<v8f &>(out);
#else
    // Exact for |x| < 2^31; beyond that (and for NaN) the int conversion gives INT_MIN, which the
    // callers clamp away or replace (exp_lanes selects +inf or 0 by x itself).
    const v8f truncated = __builtin_convertvector(__builtin_convertvector(x, v8i), v8f);
    return truncated > x ? truncated - 1.0f : truncated;
#endif
}

// A 16-lane op as two 8-lane ones, on the low and high halves.
template <typename Op>
inline v16f by_halves(const v16f &a, const v16f &b, const v16f &c, Op op) {
    v8f x[2], y[2], z[2];
    memcpy(x, &a, 64);
    memcpy(y, &b, 64);
    memcpy(z, &c, 64);
    for (int h = 0; h < 2; h++) x[h] = op(x[h], y[h], z[h]);
    v16f out;
    memcpy(&out, x, 64);
    return out;
}

// e^x, Cody-Waite range reduction and Cephes' polynomial: within ~1 fp32 ulp, like torch's own
// vectorized exp. Overflows to +inf and underflows to 0 as expf does (bar denormals).
// a * b + c. Explicitly fused here: the kernels that call exp_lanes are compiled with contraction off,
// which would otherwise split every polynomial step in two.
// Without AVX-512, two 8-lane halves give the same bits (fma rounds once either way); only a CPU
// without FMA (none of the forced ISAs of native.py) rounds twice.
// Taken by reference: callers compiled with other optimize attributes (fp-contract=off) do not
// inline it, and without AVX-512 GCC 12 passed the three 64-byte vectors on the stack and, in
// silu_and_mul's loop, never popped them (192 bytes per call: a prefill-sized call overflowed the
// OpenMP worker's stack, SIGSEGV).
inline v16f fma16(const v16f &a, const v16f &b, const v16f &c) {
#if defined(__AVX512F__)
    __m512 out = _mm512_fmadd_ps(reinterpret_cast<const __m512 &>(a), reinterpret_cast<const __m512 &>(b),
                                 reinterpret_cast<const __m512 &>(c));
    return reinterpret_cast<v16f &>(out);
#elif defined(__FMA__)
    return by_halves(a, b, c, [](const v8f &x, const v8f &y, const v8f &z) { return fma8(x, y, z); });
#else
    return a * b + c;
#endif
}

inline v16f floor16(v16f x) {
#if defined(__AVX512F__)
    __m512 out = _mm512_roundscale_ps(reinterpret_cast<__m512 &>(x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return reinterpret_cast<v16f &>(out);
#else
    return by_halves(x, x, x, [](const v8f &h, const v8f &, const v8f &) { return floor8(h); });
#endif
}

inline v16f fma_lanes(const v16f &a, const v16f &b, const v16f &c) { return fma16(a, b, c); }
inline v8f fma_lanes(const v8f &a, const v8f &b, const v8f &c) { return fma8(a, b, c); }
inline v16f floor_lanes(v16f x) { return floor16(x); }
inline v8f floor_lanes(v8f x) { return floor8(x); }

// 2^x for x <= 0 (x = -inf gives ~1e-38, which is 0 next to the terms it is added to); relative
// error ~2e-7, about one fp32 ulp. V: v16f or v8f, the same bits per lane.
template <typename V>
inline V exp2_nonpositive(V x) {
    typedef int32_t I __attribute__((vector_size(sizeof(V))));
    const V lowest = V{} - 126.0f;
    x = x < lowest ? lowest : x;
    const V whole = floor_lanes(x);
    const V f = x - whole;
    V p = fma_lanes(f, V{} + 1.535336188319500e-4f, V{} + 1.339887440266574e-3f);
    p = fma_lanes(p, f, V{} + 9.618437357674640e-3f);
    p = fma_lanes(p, f, V{} + 5.550332471162809e-2f);
    p = fma_lanes(p, f, V{} + 2.402264791363012e-1f);
    p = fma_lanes(p, f, V{} + 6.931472028550421e-1f);
    p = fma_lanes(p, f, V{} + 1.0f);
#if defined(__AVX512F__)
    if constexpr (sizeof(V) == 64) {
        // p * 2^whole in one instruction (whole >= -126: a normal power of two, so exact either way).
        __m512 out = _mm512_scalef_ps(reinterpret_cast<__m512 &>(p), reinterpret_cast<const __m512 &>(whole));
        return reinterpret_cast<V &>(out);
    }
#endif
    const I bits = (__builtin_convertvector(whole, I) + 127) << 23;
    V scale;
    memcpy(&scale, &bits, sizeof(V));
    return p * scale;
}

// e^x on either width (V: v16f or v8f, the same bits per lane).
template <typename V>
inline V exp_lanes(V x) {
    typedef int32_t I __attribute__((vector_size(sizeof(V))));
    const V n = floor_lanes(fma_lanes(x, V{} + 1.44269504088896341f, V{} + 0.5f));
    const V r = fma_lanes(n, V{} + 2.12194440e-4f, fma_lanes(n, V{} - 0.693359375f, x));
    V p = fma_lanes(r, V{} + 1.9875691500e-4f, V{} + 1.3981999507e-3f);
    p = fma_lanes(p, r, V{} + 8.3334519073e-3f);
    p = fma_lanes(p, r, V{} + 4.1665795894e-2f);
    p = fma_lanes(p, r, V{} + 1.6666665459e-1f);
    p = fma_lanes(p, r, V{} + 5.0000001201e-1f);
    p = fma_lanes(p * r, r, r + 1.0f);
    const V clamped = n < -126.0f ? V{} - 126.0f : (n > 127.0f ? V{} + 127.0f : n);
    const I bits = (__builtin_convertvector(clamped, I) + 127) << 23;
    V scale;
    memcpy(&scale, &bits, sizeof(V));
    const V result = p * scale;
    const V inf = V{} + INFINITY;
    return x > 88.72283935546875f ? inf : (x < -87.33654475f ? V{} : result);
}

// Rounded to the nearest bf16 (even on ties, NaN kept NaN), as fp32. V: v16f or v8f.
template <typename V>
inline V round_to_bf16(V x) {
    typedef uint32_t U __attribute__((vector_size(sizeof(V))));
    U u;
    memcpy(&u, &x, sizeof(V));
    const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const U nan = (u | 0x00400000u) & 0xffff0000u;
    const U out = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
    V f;
    memcpy(&f, &out, sizeof(V));
    return f;
}
// x as the reference holds it after an op in dtype T: rounded to bf16, or unchanged for fp32.
template <typename V>
inline V as_dtype(V x, const float *) { return x; }
template <typename V>
inline V as_dtype(V x, const uint16_t *) { return round_to_bf16(x); }

// ---- The CPU's native width: 16 lanes with AVX-512, else 8 ---------------------------------
// Loops whose lanes are independent (each output lane its own computation, or its own in-order
// sum) run on `vec`, so the width changes no bit; without AVX-512, 16-lane code ran up to four
// times slower than torch's own elementwise ops (a broadcast became 16 scalar stores, and GCC
// moved the two halves through the stack).
#if defined(__AVX512F__)
typedef v16f vec;
constexpr int64_t kLanes = 16;
inline vec broadcast(float x) {
    __m512 out = _mm512_set1_ps(x);
    return reinterpret_cast<vec &>(out);
}
inline vec load_vec(const uint16_t *p) { return load16(p); }
inline vec load_vec(const float *p) { return load16(p); }
inline void store_vec(float *p, vec x) { store16(p, x); }
inline void store_vec(uint16_t *p, vec x) { store16(p, x); }
#else
typedef v8f vec;
constexpr int64_t kLanes = 8;
inline vec broadcast(float x) { return vec{x, x, x, x, x, x, x, x}; }
inline vec load_vec(const uint16_t *p) { return load8(p); }
inline vec load_vec(const float *p) { return load8(p); }
inline void store_vec(float *p, vec x) { memcpy(p, &x, sizeof(x)); }
// Round to nearest even, NaN kept NaN: store16's 8 lanes.
inline void store_vec(uint16_t *p, vec x) {
    typedef uint32_t v8u __attribute__((vector_size(32)));
    typedef uint16_t v8h __attribute__((vector_size(16)));
    const vec rounded = round_to_bf16(x);
    v8u u;
    memcpy(&u, &rounded, sizeof(u));
    const v8h h = __builtin_convertvector(u >> 16, v8h);
    memcpy(p, &h, sizeof(h));
}
#endif

// The first n (< kLanes) elements, zero-padded; and the store of the first n lanes. Tails of rows
// go through these, so each kernel has one code path.
template <typename T>
inline vec load_partial(const T *p, int64_t n) {
    T buffer[kLanes] = {};
    memcpy(buffer, p, n * sizeof(T));
    return load_vec(buffer);
}
template <typename T>
inline void store_partial(T *p, vec x, int64_t n) {
    T buffer[kLanes];
    store_vec(buffer, x);
    memcpy(p, buffer, n * sizeof(T));
}
template <typename T>
inline vec load_n(const T *p, int64_t n) { return n >= kLanes ? load_vec(p) : load_partial(p, n); }
template <typename T>
inline void store_n(T *p, vec x, int64_t n) {
    if (n >= kLanes) store_vec(p, x); else store_partial(p, x, n);
}

}  // namespace radixserve_vec
