// Shared by the engine's AVX2 Linear kernels (int8_avx2.cpp, int4_avx2.cpp): fbgemm's dynamic
// 7-bit activation quantisation and its epilogue (int8_avx2.cpp has the maths), and the 8 x 8
// word transpose that reads a block layout back into plain weight rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

struct QParams {
  float scale;
  int32_t zero_point;
};

// torch's choice of affine parameters for dynamic quantisation with reduce_range (0..127):
// the range always includes 0, and the zero point comes from the end with the smaller error.
inline QParams choose_qparams(float lo, float hi) {
  lo = std::min(lo, 0.f);
  hi = std::max(hi, 0.f);
  constexpr int32_t qmin = 0, qmax = 127;
  double scale = (static_cast<double>(hi) - lo) / (qmax - qmin);
  if (static_cast<float>(scale) == 0.0f || std::isinf(1.0f / static_cast<float>(scale))) {
    scale = 0.1;
  }
  const double zp_from_min = qmin - lo / scale;
  const double zp_from_max = qmax - hi / scale;
  const double zp_from_min_error = std::abs(qmin) - std::abs(lo / scale);
  const double zp_from_max_error = std::abs(qmax) - std::abs(hi / scale);
  const double zp = zp_from_min_error < zp_from_max_error ? zp_from_min : zp_from_max;
  int32_t nudged;
  if (zp < qmin) {
    nudged = qmin;
  } else if (zp > qmax) {
    nudged = qmax;
  } else {
    nudged = static_cast<int32_t>(std::nearbyint(zp));
  }
  return {static_cast<float>(scale), nudged};
}

inline void min_max(const float* x, int64_t n, float* lo, float* hi) {
  __m256 vlo = _mm256_set1_ps(0.f), vhi = _mm256_set1_ps(0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vlo = _mm256_min_ps(vlo, v);
    vhi = _mm256_max_ps(vhi, v);
  }
  alignas(32) float l[8], h[8];
  _mm256_store_ps(l, vlo);
  _mm256_store_ps(h, vhi);
  float mn = 0.f, mx = 0.f;
  for (int j = 0; j < 8; ++j) {
    mn = std::min(mn, l[j]);
    mx = std::max(mx, h[j]);
  }
  for (; i < n; ++i) {
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
  }
  *lo = mn;
  *hi = mx;
}

// round(x / scale) + zero_point, clamped to 0..127. Rounding half to even, as nearbyint in the
// default rounding mode and as vcvtps2dq.
inline void quantize(const float* x, int64_t n, QParams q, uint8_t* out) {
  const float inverse = 1.0f / q.scale;
  const __m256 vinv = _mm256_set1_ps(inverse);
  const __m256 vzp = _mm256_set1_ps(static_cast<float>(q.zero_point));
  const __m256i vmin = _mm256_setzero_si256(), vmax = _mm256_set1_epi32(127);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i v = _mm256_cvtps_epi32(_mm256_fmadd_ps(_mm256_loadu_ps(x + i), vinv, vzp));
    v = _mm256_min_epi32(_mm256_max_epi32(v, vmin), vmax);
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), v);
    for (int j = 0; j < 8; ++j) out[i + j] = static_cast<uint8_t>(t[j]);
  }
  for (; i < n; ++i) {
    const float zp = static_cast<float>(q.zero_point);
    const int32_t v = static_cast<int32_t>(std::nearbyint(std::fma(x[i], inverse, zp)));
    out[i] = static_cast<uint8_t>(std::min(127, std::max(0, v)));
  }
}

// float(acc - zp * rowsum) * (w_scale * x_scale) + bias for 8 output channels (bias may be
// null): the bias added with a fused multiply-add, as fbgemm's epilogue.
inline __m256 dequantize8(__m256i acc, const int32_t* rowsum, const float* w_scale,
                          const float* bias, QParams q) {
  const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowsum));
  acc = _mm256_sub_epi32(acc, _mm256_mullo_epi32(sums, _mm256_set1_epi32(q.zero_point)));
  const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(w_scale), _mm256_set1_ps(q.scale));
  return bias != nullptr ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), scale, _mm256_loadu_ps(bias))
                         : _mm256_mul_ps(_mm256_cvtepi32_ps(acc), scale);
}

// v[i] word j -> v[j] word i: eight registers of eight 4-byte words, transposed in place.
inline void transpose8x8_epi32(__m256i v[8]) {
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

#pragma GCC pop_options
