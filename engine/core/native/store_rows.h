// Shared by the engine's AVX2 Linear kernels (int8_avx2.cpp, int4_avx2.cpp).
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
