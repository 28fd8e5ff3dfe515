// Snake and the uint8 quantisation of its output in one kernel, for the int8 HiFT's residual
// convolutions (engine.core.hift_int8.Int8Conv.after_snake).
//
// Why: every residual convolution of the int8 HiFT reads a Snake output and only quantised. In
// torch that is mul, sin, square, addcmul, aminmax, quantize_per_tensor and int_repr: seven
// passes over the activation, one of them SLEEF's sin. Here it is two: the Snake and its range
// (the float result kept in a scratch buffer), then the quantisation.
//
// What it computes, as the torch path (engine.core.snake.Snake, then hift_int8's
// quantize_activation) does:
// - Snake: y = x + sin²(α·x) · (1 / (α + 1e-9)) per channel; α·x and the reciprocal rounded as
//   torch rounds them, the last multiply-add fused as torch's AVX2 addcmul is. Only sin differs:
//   this kernel's own (sin_squared below: relative error under 4·2⁻²⁴ for |αx| <= 1000, 6·2⁻²⁴
//   up to 1e5; SLEEF's sin squared: 3·2⁻²⁴), so a few Snake values in a hundred move by an ulp.
// - Range over the whole tensor, zero included; scale = max(hi − lo, 1e-12) / 255 and
//   zero point = round(−lo / scale) (half to even) clamped to 0..255, both in double.
// - Codes as fbgemm's quantize_per_tensor (what torch calls on x86): round(y · (1/scale)) half to
//   even, with 1/scale in float32, plus the zero point, clamped to 0..255. Given the same Snake
//   values, the codes are equal to the bit.
// - A causal convolution's left padding (zeros, so its code is the zero point) is written first.
//
// The kernels are compiled for AVX2 and FMA only (the pragma below), the module itself for any
// x86-64: it imports on every x86-64 CPU, and ``supported()`` says whether the kernels may run.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

bool supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

constexpr int64_t kGrain = 16384;  // elements per parallel chunk (the loops are bandwidth-light)
constexpr int32_t kQmax = 255;

// sin(r) ≈ r + r³·P(r²) on [−π/2, π/2]: a minimax fit of the relative error (≈ 6e-9, a tenth of
// a float32 ulp), made for this kernel (Remez; docs/dev/int8-kernel.md).
constexpr float kSin1 = -0x1.55554cp-3f;
constexpr float kSin2 = 0x1.110ed4p-7f;
constexpr float kSin3 = -0x1.9f6ffep-13f;
constexpr float kSin4 = 0x1.5dbdf0p-19f;
// π in three parts for the reduction (Cody–Waite): each product k·part is exact in the fused
// multiply-adds, so r = z − k·π keeps its accuracy for |z| up to ~1e5.
constexpr float kPi1 = 0x1.921fb6p+1f;
constexpr float kPi2 = -0x1.777a5cp-24f;
constexpr float kPi3 = -0x1.ee59dap-49f;
constexpr float kInvPi = 0x1.45f306p-2f;

// sin²(z): sin² has period π, so z is reduced to r = z − k·π in [−π/2, π/2] (k = round(z/π)) and
// sin(r) squared; no quadrant to track.
inline __m256 sin_squared(__m256 z) {
  const __m256 k =
      _mm256_round_ps(_mm256_mul_ps(z, _mm256_set1_ps(kInvPi)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kPi1), z);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kPi2), r);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kPi3), r);
  const __m256 u = _mm256_mul_ps(r, r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kSin4), u, _mm256_set1_ps(kSin3));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(kSin2));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(kSin1));
  const __m256 s = _mm256_fmadd_ps(_mm256_mul_ps(r, u), p, r);
  return _mm256_mul_ps(s, s);
}

inline __m256 snake8(__m256 x, __m256 alpha, __m256 inverse) {
  return _mm256_fmadd_ps(sin_squared(_mm256_mul_ps(x, alpha)), inverse, x);
}

// Lanes [0, n) of a vector (n < 8), for the channels past the last whole vector.
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

struct Range {
  float lo = 0.f, hi = 0.f;  // zero is in every range
};

// The Snake of time steps [t0, t1) of a (time, channel) block into y; returns their range.
Range snake_rows(const float* x, const float* alpha, const float* inverse, int64_t channels,
                 int64_t t0, int64_t t1, float* y) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const int64_t whole = channels / 8 * 8;
  const __m256i tail = lane_mask(channels - whole);
  for (int64_t t = t0; t < t1; ++t) {
    const float* xt = x + t * channels;
    float* yt = y + t * channels;
    int64_t c = 0;
    for (; c < whole; c += 8) {
      const __m256 v = snake8(_mm256_loadu_ps(xt + c), _mm256_loadu_ps(alpha + c),
                              _mm256_loadu_ps(inverse + c));
      _mm256_storeu_ps(yt + c, v);
      lo = _mm256_min_ps(lo, v);
      hi = _mm256_max_ps(hi, v);
    }
    if (c < channels) {  // lanes past the end read as 0 and give Snake(0) = 0: in the range
      const __m256 v = snake8(_mm256_maskload_ps(xt + c, tail), _mm256_maskload_ps(alpha + c, tail),
                              _mm256_maskload_ps(inverse + c, tail));
      _mm256_maskstore_ps(yt + c, tail, v);
      lo = _mm256_min_ps(lo, v);
      hi = _mm256_max_ps(hi, v);
    }
  }
  alignas(32) float l[8], h[8];
  _mm256_store_ps(l, lo);
  _mm256_store_ps(h, hi);
  Range range;
  for (int j = 0; j < 8; ++j) {
    range.lo = std::min(range.lo, l[j]);
    range.hi = std::max(range.hi, h[j]);
  }
  return range;
}

// fbgemm's quantize_per_tensor: clamp(round(y · inverse) + zero_point, 0, 255), rounding half to
// even (vcvtps2dq; nearbyint in the default rounding mode). The saturating packs clamp.
void quantize(const float* y, int64_t n, float inverse, int32_t zero_point, uint8_t* out) {
  const __m256 vinv = _mm256_set1_ps(inverse);
  const __m256i vzp = _mm256_set1_epi32(zero_point);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_add_epi32(
          _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(y + i + 8 * j), vinv)), vzp);
    }
    const __m256i bytes =
        _mm256_packus_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; i < n; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(y[i] * inverse)) + zero_point;
    out[i] = static_cast<uint8_t>(std::min(kQmax, std::max(0, v)));
  }
}

#pragma GCC pop_options

// --- the Python surface ----------------------------------------------------------------------

struct Snake {
  at::Tensor x;  // (1, C, 1, L) float32, channels-last contiguous
  std::vector<float> alpha, inverse;
  int64_t channels, steps;
};

Snake prepare(const at::Tensor& x_in, const at::Tensor& alpha_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 4 && x_in.size(0) == 1 &&
                  x_in.size(2) == 1,
              "a float32 (1, C, 1, L) activation");
  TORCH_CHECK(alpha_in.numel() == x_in.size(1), "one alpha per channel");
  TORCH_CHECK(alpha_in.scalar_type() == at::kFloat && alpha_in.is_contiguous(),
              "float32 alphas");
  Snake s;
  s.x = x_in.contiguous(at::MemoryFormat::ChannelsLast);
  s.channels = x_in.size(1);
  s.steps = x_in.size(3);
  const float* a = alpha_in.data_ptr<float>();  // read only: no autograd view needed
  s.alpha.assign(a, a + s.channels);
  s.inverse.resize(s.channels);
  // As torch computes 1.0 / (alpha + 1e-9) on float32: the sum, then the reciprocal, rounded.
  for (int64_t c = 0; c < s.channels; ++c) s.inverse[c] = 1.0f / (a[c] + 1e-9f);
  return s;
}

// The Snake of s into y (steps × channels floats); returns the range over all of it.
Range snake_into(const Snake& s, float* y) {
  const float* x = s.x.data_ptr<float>();
  std::vector<Range> ranges(static_cast<size_t>(at::get_num_threads()));
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, s.channels));
  at::parallel_for(0, s.steps, grain, [&](int64_t t0, int64_t t1) {
    const Range r = snake_rows(x, s.alpha.data(), s.inverse.data(), s.channels, t0, t1, y);
    Range& mine = ranges[static_cast<size_t>(at::get_thread_num())];
    mine.lo = std::min(mine.lo, r.lo);
    mine.hi = std::max(mine.hi, r.hi);
  });
  Range all;
  for (const Range& r : ranges) {
    all.lo = std::min(all.lo, r.lo);
    all.hi = std::max(all.hi, r.hi);
  }
  return all;
}

at::Tensor empty_like_activation(int64_t channels, int64_t steps, at::ScalarType dtype) {
  return at::empty({1, channels, 1, steps},
                   at::TensorOptions().dtype(dtype).memory_format(at::MemoryFormat::ChannelsLast));
}

// Snake(x) as float32 (1, C, 1, L) channels-last: the kernel's first pass on its own.
at::Tensor snake(const at::Tensor& x, const at::Tensor& alpha) {
  const Snake s = prepare(x, alpha);
  at::Tensor y = empty_like_activation(s.channels, s.steps, at::kFloat);
  snake_into(s, y.data_ptr<float>());
  return y;
}

// Snake(x), ``left`` zero steps before it, as uint8 (1, C, 1, left + L) channels-last with its
// scale and zero point (the torch path's quantize_activation of F.pad(Snake(x), (left, 0))).
std::tuple<at::Tensor, double, int64_t> snake_quantize(const at::Tensor& x,
                                                       const at::Tensor& alpha, int64_t left) {
  TORCH_CHECK(left >= 0, "left padding must be >= 0");
  const Snake s = prepare(x, alpha);
  const int64_t n = s.channels * s.steps;
  const at::Tensor scratch = at::empty({n}, at::kFloat);  // not zeroed: all written
  const float* y = scratch.data_ptr<float>();
  const Range range = snake_into(s, scratch.data_ptr<float>());

  const double lo = range.lo, hi = range.hi;  // zero included
  const double scale = std::max(hi - lo, 1e-12) / kQmax;
  const int32_t zero_point =
      std::min(kQmax, std::max(0, static_cast<int32_t>(std::nearbyint(-lo / scale))));

  at::Tensor q = empty_like_activation(s.channels, left + s.steps, at::kByte);
  uint8_t* out = q.data_ptr<uint8_t>();
  std::memset(out, zero_point, static_cast<size_t>(left * s.channels));
  out += left * s.channels;
  const float inverse = 1.0f / static_cast<float>(scale);
  at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
    quantize(y + i0, i1 - i0, inverse, zero_point, out + i0);
  });
  return {q, scale, zero_point};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Snake + uint8 activation quantisation for the int8 HiFT (engine.core.hift_int8)";
  m.def("supported", &supported, "Whether this CPU has AVX2 and FMA (the kernels need both)");
  m.def("snake", &snake, "Snake(x) on a (1, C, 1, L) channels-last float32 tensor",
        py::arg("x"), py::arg("alpha"));
  m.def("snake_quantize", &snake_quantize,
        "Snake(x) with `left` zero steps before it, as uint8 with its scale and zero point",
        py::arg("x"), py::arg("alpha"), py::arg("left"));
}
