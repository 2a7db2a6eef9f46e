// What the AMX kernels (amx_linear.cpp, amx_attention.cpp) share.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RADIXSERVE_AMX 1

namespace radixserve_amx {

struct TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

// Tile t gets rows[t] rows of 64 bytes (0: unused). The configuration is per thread.
inline void configure_tiles(const int (&rows)[8]) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        if (rows[t] == 0) continue;
        config.rows[t] = static_cast<uint8_t>(rows[t]);
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

inline __m512 widen_bf16(const uint16_t *p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

}  // namespace radixserve_amx

#endif
