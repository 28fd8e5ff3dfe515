// Shared by the engine's AVX2 Linear kernels (int8_avx2.cpp, int4_avx2.cpp): writing a block's
// outputs, and reading a block layout back into plain weight rows (their many-row GEMM path).
#pragma once

#include <immintrin.h>

#include <cstdint>

// Eight outputs n0..n0+7 of one row into y; the last block of a layer may be part padding,
// whose outputs are not written.
__attribute__((target("avx2"))) inline void store_block(float* y, int64_t n0,
                                                        int64_t out_features, __m256 values) {
  if (n0 + 8 <= out_features) {
    _mm256_storeu_ps(y + n0, values);
    return;
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, values);
  for (int64_t i = 0; n0 + i < out_features; ++i) y[n0 + i] = t[i];
}

// v[i] word j -> v[j] word i: eight registers of eight 4-byte words, transposed in place.
__attribute__((target("avx2"))) inline void transpose8x8_epi32(__m256i v[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int r = 0; r < 4; ++r) {
    v[r] = _mm256_permute2x128_si256(u[r], u[r + 4], 0x20);
    v[r + 4] = _mm256_permute2x128_si256(u[r], u[r + 4], 0x31);
  }
}
