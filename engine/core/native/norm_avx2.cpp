// RMS normalisation for x86 CPUs with AVX2: y = (x * rsqrt(mean(x^2) + eps)) * weight per row,
// in one call.
//
// Why: the Qwen2 LM (CosyVoice2, Fun-CosyVoice3) normalises its one row twice per layer and
// once at the end of every decode step: 49 norms a token. torch's CPU rms_norm is a composite of
// about eight operators (square, mean, add, rsqrt, two multiplies and their allocations), and
// at one row of 896 values their dispatch costs far more than the arithmetic: about 4 ms of a
// 23 ms CosyVoice2 token on one core of the AVX2 Zen 3 host. Here it is one operator.
//
// The same formula and order as torch's (the mean of squares in float32, then rsqrt, then x
// times it, then times the weight); the sum of squares is accumulated in 8 lanes and reduced
// at the end, so it can differ from torch's in the last bits of the mean.
//
// The kernel is compiled for AVX2 and FMA only (the pragma below), the module itself for any
// x86-64: it imports on every x86-64 CPU, and ``supported()`` says whether it may run.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

bool supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

float sum_of_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

void normalise_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  const float rstd = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  const __m256 r = _mm256_set1_ps(rstd);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), r);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(v, _mm256_loadu_ps(w + i)));
  }
  for (; i < n; ++i) y[i] = (x[i] * rstd) * w[i];
}

#pragma GCC pop_options

// x (..., d; float32), weight (d; float32) -> (..., d).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, "float32 (..., d)");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.size(0) == x_in.size(-1),
              "a contiguous float32 weight of the last dimension's size");
  const at::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t d = x.size(-1), rows = d > 0 ? x.numel() / d : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    normalise_row(xp + r * d, wp, d, static_cast<float>(eps), yp + r * d);
  }
  return y;
}

}  // namespace

// As a torch operator too: the decode step (decode_step_avx2.cpp) calls it from C++.
TORCH_LIBRARY_FRAGMENT(engine, m) { m.def("rms_norm", &rms_norm); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "RMS normalisation in one operator for AVX2 CPUs (engine.cosyvoice2.qwen2.RMSNorm)";
  m.def("supported", &supported, "Whether this CPU has AVX2 and FMA (the kernel needs both)");
  m.def("rms_norm", &rms_norm, "(x * rsqrt(mean(x^2) + eps)) * weight over the last dimension",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
}
