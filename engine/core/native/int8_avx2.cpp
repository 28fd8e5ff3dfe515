// Dynamic int8 Linear for x86 CPUs with AVX2: the arithmetic of torch's fbgemm dynamic Linear
// (``quantized::linear_dynamic`` with reduce_range), bit for bit, with a weight layout made for
// the LM's decode step, where one row of activations meets every weight once per token.
//
// Why: at one row fbgemm reads the weights at about half the bandwidth one core can stream
// (docs/dev/int8-kernel.md). Here the weights are stored in blocks of 8 output channels x 4
// inputs (32 bytes: one AVX2 register), so one broadcast of 4 quantised inputs meets 8 outputs
// per multiply, and each thread walks 4 blocks' streams side by side so the prefetchers keep
// several sequential reads in flight.
//
// The maths, as fbgemm's: the activations (all rows together) are quantised to unsigned 7-bit
// (0..127, reduce_range) with one scale and zero point chosen as torch chooses them; the weights
// are symmetric per-channel int8. 7-bit activations keep vpmaddubsw's pair sums inside int16.
// out = float(acc - zp * rowsum) * (w_scale * x_scale) + bias, then ReLU if asked.
//
// Many rows (a prompt's prefill) may take an int8 GEMM for the sums instead (``matmul_rows``,
// chosen in engine/core/int8_avx2.py where those sums are exact): AMX's tiles where this process
// may use them (amx_int8.h), else oneDNN's; the same codes and the same epilogue, the weight
// read back from its blocks a slab at a time.
//
// The kernels are compiled for AVX2 and FMA only (the pragma below), the module itself for any
// x86-64: it imports on every x86-64 CPU, and ``supported()`` says whether the kernels may run.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_int8.h"
#include "slab_gemm.h"
#include "store_rows.h"

namespace {

bool supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

constexpr int64_t kRows = 8;      // output channels per block (one register of int32 sums)
constexpr int64_t kDepth = 4;     // inputs per block row (vpmaddubsw + vpmaddwd sum 4 products)
constexpr int64_t kBlockBytes = kRows * kDepth;
constexpr int kStreams = 4;       // row blocks walked side by side at one activation row
constexpr int kRowGroup = 4;      // activation rows computed together against one weight load
constexpr int64_t kTileBytes = 256 * 1024;  // weight bytes kept hot in L2 across row groups
constexpr int64_t kSlabBytes = 1024 * 1024;  // weight bytes per GEMM of many rows

struct QParams {
  float scale;
  int32_t zero_point;
};

// torch's choice of affine parameters for dynamic quantisation with reduce_range (0..127):
// the range always includes 0, and the zero point comes from the end with the smaller error.
QParams choose_qparams(float lo, float hi) {
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

void min_max(const float* x, int64_t n, float* lo, float* hi) {
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
void quantize(const float* x, int64_t n, QParams q, uint8_t* out) {
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

struct Layer {
  const int8_t* weight;   // packed blocks
  const int32_t* rowsum;  // per output channel, padded to whole blocks
  const float* scale;     // per output channel, padded
  const float* bias;      // per output channel, padded, or null
  int64_t in_features, out_features;
  bool relu;
};

inline void store(const Layer& layer, int64_t block, __m256i acc, QParams q, float* y) {
  const int64_t n0 = block * kRows;
  const __m256i rowsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(layer.rowsum + n0));
  acc = _mm256_sub_epi32(acc, _mm256_mullo_epi32(rowsum, _mm256_set1_epi32(q.zero_point)));
  const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(layer.scale + n0), _mm256_set1_ps(q.scale));
  __m256 out = layer.bias != nullptr
                   ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), scale, _mm256_loadu_ps(layer.bias + n0))
                   : _mm256_mul_ps(_mm256_cvtepi32_ps(acc), scale);
  if (layer.relu) out = _mm256_max_ps(out, _mm256_setzero_ps());
  store_block(y, n0, layer.out_features, out);
}

inline __m256i dot4(__m256i acc, __m256i x, const int8_t* w, __m256i ones) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, wv), ones));
}

inline __m256i broadcast4(const uint8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm256_set1_epi32(v);
}

// One activation row against blocks [b0, b1): the range is cut into kStreams parts walked side
// by side.
void one_row(const Layer& layer, const uint8_t* xq, QParams q, int64_t b0, int64_t b1, float* y) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t steps = layer.in_features / kDepth;
  const int64_t stride = steps * kBlockBytes;
  const int64_t per_stream = (b1 - b0) / kStreams;
  for (int64_t i = 0; i < per_stream; ++i) {
    const int8_t* w[kStreams];
    __m256i acc[kStreams];
    for (int s = 0; s < kStreams; ++s) {
      w[s] = layer.weight + (b0 + s * per_stream + i) * stride;
      acc[s] = _mm256_setzero_si256();
    }
    for (int64_t k = 0; k < steps; ++k) {
      const __m256i xv = broadcast4(xq + k * kDepth);
      for (int s = 0; s < kStreams; ++s) acc[s] = dot4(acc[s], xv, w[s] + k * kBlockBytes, ones);
    }
    for (int s = 0; s < kStreams; ++s) store(layer, b0 + s * per_stream + i, acc[s], q, y);
  }
  for (int64_t b = b0 + kStreams * per_stream; b < b1; ++b) {
    const int8_t* w = layer.weight + b * stride;
    __m256i acc = _mm256_setzero_si256();
    for (int64_t k = 0; k < steps; ++k) acc = dot4(acc, broadcast4(xq + k * kDepth), w + k * kBlockBytes, ones);
    store(layer, b, acc, q, y);
  }
}

// R activation rows (R <= kRowGroup) against B adjacent blocks (B <= 2): each weight load
// serves R rows and each broadcast of 4 inputs serves B blocks.
template <int R, int B>
void row_group(const Layer& layer, const uint8_t* xq, QParams q, int64_t block, float* y) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t in = layer.in_features, steps = in / kDepth;
  const int8_t* w = layer.weight + block * steps * kBlockBytes;
  const int64_t stride = steps * kBlockBytes;
  __m256i acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < steps; ++k) {
    __m256i wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * stride + k * kBlockBytes));
    for (int r = 0; r < R; ++r) {
      const __m256i xv = broadcast4(xq + r * in + k * kDepth);
      for (int b = 0; b < B; ++b)
        acc[b][r] = _mm256_add_epi32(acc[b][r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, wv[b]), ones));
    }
  }
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) store(layer, block + b, acc[b][r], q, y + r * layer.out_features);
}

template <int R>
void row_group_tile(const Layer& layer, const uint8_t* xq, QParams q, int64_t t0, int64_t t1, float* y) {
  int64_t b = t0;
  for (; b + 2 <= t1; b += 2) row_group<R, 2>(layer, xq, q, b, y);
  if (b < t1) row_group<R, 1>(layer, xq, q, b, y);
}

// Every activation row against blocks [b0, b1), a tile of blocks at a time so that the tile's
// weights stay in L2 while every row group passes over them.
void many_rows(const Layer& layer, const uint8_t* xq, int64_t rows, QParams q, int64_t b0,
               int64_t b1, float* y) {
  const int64_t in = layer.in_features, out = layer.out_features;
  const int64_t tile = std::max<int64_t>(1, kTileBytes / (in * kRows));
  for (int64_t t0 = b0; t0 < b1; t0 += tile) {
    const int64_t t1 = std::min(b1, t0 + tile);
    for (int64_t m = 0; m < rows; m += kRowGroup) {
      const uint8_t* x = xq + m * in;
      float* ym = y + m * out;
      switch (std::min<int64_t>(kRowGroup, rows - m)) {
        case 4: row_group_tile<4>(layer, x, q, t0, t1, ym); break;
        case 3: row_group_tile<3>(layer, x, q, t0, t1, ym); break;
        case 2: row_group_tile<2>(layer, x, q, t0, t1, ym); break;
        default: row_group_tile<1>(layer, x, q, t0, t1, ym); break;
      }
    }
  }
}

// Blocks [b0, b1) of rows [r0, r1) of the layer's outputs from their integer sums ``acc`` (a row
// of ``width`` int32 per activation row from block b0 on): the kernels' own epilogue.
void finish_rows(const Layer& layer, const int32_t* acc, int64_t width, QParams q, int64_t b0,
                 int64_t b1, int64_t r0, int64_t r1, float* y) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = b0; b < b1; ++b)
      store(layer, b,
            _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(acc + r * width + (b - b0) * kRows)),
            q, y + r * layer.out_features);
}

// Blocks [b0, b1) of the layer's weight as plain rows of ``dst`` (8 int8 rows of ``in`` a block,
// block ``first`` at row 0): eight 32-byte blocks (eight steps of 4 inputs, each for the block's
// 8 channels) are an 8 x 8 matrix of 4-byte words, whose transpose is 32 bytes of each row.
void unpack_blocks(const Layer& layer, int64_t b0, int64_t b1, int64_t first, int8_t* dst) {
  const int64_t in = layer.in_features, steps = in / kDepth;
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* src = layer.weight + b * steps * kBlockBytes;
    int8_t* rows = dst + (b - first) * kRows * in;
    int64_t k = 0;
    for (; k + 8 <= steps; k += 8) {
      __m256i v[8];
      for (int i = 0; i < 8; ++i)
        v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (k + i) * kBlockBytes));
      transpose8x8_epi32(v);
      for (int r = 0; r < 8; ++r)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + r * in + k * kDepth), v[r]);
    }
    for (; k < steps; ++k)
      for (int64_t r = 0; r < kRows; ++r)
        std::memcpy(rows + r * in + k * kDepth, src + k * kBlockBytes + r * kDepth, kDepth);
  }
}

// Blocks [b0, b1) in AMX's tile order (amx_int8.h; block ``first``'s channels first): a block's
// 32 bytes for 4 inputs are already the tile's 4-byte groups of its 8 channels.
void tile_blocks(const Layer& layer, int64_t b0, int64_t b1, int64_t first, int8_t* dst) {
  const int64_t in = layer.in_features, steps = in / kDepth;
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* src = layer.weight + b * steps * kBlockBytes;
    int8_t* column = dst + amx_int8::column((b - first) * kRows, in);
    for (int64_t k = 0; k < steps; ++k)
      std::memcpy(column + amx_int8::quad(k), src + k * kBlockBytes, kBlockBytes);
  }
}

#pragma GCC pop_options

// All rows of codes ``xq`` against the layer by integer GEMM, a slab of output blocks at a time
// (slab_gemm.h): each slab's weight read back from its blocks for the GEMM, its sums read by the
// epilogue while they are in L2.
void gemm_rows(const Layer& layer, const uint8_t* xq, int64_t rows, QParams q, float* y) {
  const int64_t in = layer.in_features;
  const int64_t blocks = (layer.out_features + kRows - 1) / kRows;
  const SlabGemm gemm(in, rows, blocks, kSlabBytes);
  const at::Tensor codes = gemm.codes();  // codes 0..127 are the same bytes as int8
  std::memcpy(codes.data_ptr<int8_t>(), xq, static_cast<size_t>(rows * in));
  const at::Tensor weight = gemm.weight();
  int8_t* dst = weight.data_ptr<int8_t>();
  for (int64_t s0 = 0; s0 < blocks; s0 += gemm.slab) {
    const int64_t n = std::min(gemm.slab, blocks - s0);
    gemm.clear(weight, n);
    at::parallel_for(s0, s0 + n, 8, [&](int64_t b0, int64_t b1) {
      if (gemm.amx)
        tile_blocks(layer, b0, b1, s0, dst);
      else
        unpack_blocks(layer, b0, b1, s0, dst);
    });
    const at::Tensor acc = gemm.sums(codes, weight, n);
    const int32_t* ap = acc.data_ptr<int32_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      finish_rows(layer, ap, acc.size(1), q, s0, s0 + n, r0, r1, y);
    });
  }
}

// codes (m, k) . weight (n, k)^T -> int32 (m, n) on AMX's tiles (k a multiple of 64): the
// many-row GEMM's sums, for the engine's check that they are exact here and for the tests.
at::Tensor amx_matmul(const at::Tensor& codes_in, const at::Tensor& weight_in) {
  TORCH_CHECK(amx_int8::ready(), "this process cannot use AMX's int8 tiles");
  TORCH_CHECK(codes_in.scalar_type() == at::kChar && codes_in.dim() == 2 &&
                  weight_in.scalar_type() == at::kChar && weight_in.dim() == 2 &&
                  codes_in.size(1) == weight_in.size(1),
              "int8 (m, k) codes and an int8 (n, k) weight");
  const int64_t m = codes_in.size(0), k = codes_in.size(1), n = weight_in.size(0);
  TORCH_CHECK(k % amx_int8::kDepth == 0, "k must be a multiple of ", amx_int8::kDepth);
  const at::Tensor codes = codes_in.contiguous(), weight = weight_in.contiguous();
  const int64_t rows = amx_int8::pairs(m) * amx_int8::kPair;
  const int64_t pairs = amx_int8::pairs(n);
  at::Tensor x = at::zeros({rows, k}, at::kChar);
  std::memcpy(x.data_ptr<int8_t>(), codes.data_ptr<int8_t>(), static_cast<size_t>(m * k));
  at::Tensor tiled = at::zeros({pairs * amx_int8::kPair, k}, at::kChar);
  const int8_t* w = weight.data_ptr<int8_t>();
  int8_t* t = tiled.data_ptr<int8_t>();
  for (int64_t c = 0; c < n; ++c)
    for (int64_t g = 0; g < k / 4; ++g)
      std::memcpy(t + amx_int8::column(c, k) + amx_int8::quad(g), w + c * k + 4 * g, 4);
  at::Tensor out = at::empty({rows, pairs * amx_int8::kPair}, at::kInt);
  amx_int8::sums(x.data_ptr<int8_t>(), m, k, t, pairs, out.data_ptr<int32_t>());
  return out.narrow(0, 0, m).narrow(1, 0, n).contiguous();
}

// --- the Python surface ----------------------------------------------------------------------

// weight (out x in, int8, symmetric) -> (blocks, rowsum): blocks of 8 output channels, each
// 4 inputs of the 8 channels in turn; channels padded with zeros to a whole block.
std::vector<at::Tensor> pack(const at::Tensor& weight_in) {
  TORCH_CHECK(weight_in.scalar_type() == at::kChar && weight_in.dim() == 2,
              "an int8 weight of shape (out, in)");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(in % kDepth == 0, "in_features must be a multiple of ", kDepth);
  const int64_t blocks = (out + kRows - 1) / kRows, steps = in / kDepth;
  at::Tensor packed = at::zeros({blocks * kRows * in}, at::kChar);
  at::Tensor rowsum = at::zeros({blocks * kRows}, at::kInt);
  const int8_t* src = weight.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* sums = rowsum.data_ptr<int32_t>();
  for (int64_t n = 0; n < out; ++n) {
    int32_t s = 0;
    for (int64_t k = 0; k < in; ++k) s += src[n * in + k];
    sums[n] = s;
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t k = 0; k < steps; ++k) {
      int8_t* block = dst + (b * steps + k) * kBlockBytes;
      for (int64_t r = 0; r < kRows && b * kRows + r < out; ++r) {
        std::memcpy(block + r * kDepth, src + (b * kRows + r) * in + k * kDepth, kDepth);
      }
    }
  }
  return {packed, rowsum};
}

// x (..., in; float32) -> (..., out; float32). Shapes are handled here, not by views in Python:
// one dispatched operator per call (the output's allocation), as torch's own int8 layer.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed,
                  const at::Tensor& rowsum, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& bias, int64_t out_features, bool relu,
                  int64_t matmul_rows) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, "float32 (..., in)");
  const at::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const int64_t in = x.size(-1), rows = in > 0 ? x.numel() / in : 0;
  const int64_t blocks = (out_features + kRows - 1) / kRows;
  TORCH_CHECK(packed.numel() == blocks * kRows * in, "packed weight does not match the input");
  TORCH_CHECK(rowsum.numel() == blocks * kRows && scale.numel() == blocks * kRows,
              "rowsum and scale padded to whole blocks");
  TORCH_CHECK(!bias || bias->numel() == blocks * kRows, "bias padded to whole blocks");
  const Layer layer{packed.data_ptr<int8_t>(), rowsum.data_ptr<int32_t>(), scale.data_ptr<float>(),
                    bias ? bias->data_ptr<float>() : nullptr, in, out_features, relu};
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::empty(out_shape, x.options());
  if (rows == 0) return y;

  float lo, hi;
  min_max(x.data_ptr<float>(), x.numel(), &lo, &hi);
  const QParams q = choose_qparams(lo, hi);
  std::vector<uint8_t> xq(static_cast<size_t>(x.numel()));
  quantize(x.data_ptr<float>(), x.numel(), q, xq.data());

  float* yp = y.data_ptr<float>();
  if (matmul_rows > 0 && rows >= matmul_rows) {
    // Many rows where oneDNN's int8 GEMM computes the same sums faster (VNNI, AMX: decided in
    // engine.core.int8_avx2): codes 0..127 are the same bytes as int8.
    gemm_rows(layer, xq.data(), rows, q, yp);
  } else if (rows == 1) {
    at::parallel_for(0, blocks, kStreams * 4, [&](int64_t b0, int64_t b1) {
      one_row(layer, xq.data(), q, b0, b1, yp);
    });
  } else {
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      many_rows(layer, xq.data(), rows, q, b0, b1, yp);
    });
  }
  return y;
}

// How many of torch's threads one of the kernel's parallel loops runs on (a build without
// OpenMP runs every loop on the caller's thread alone).
int64_t threads_in_a_loop() {
  std::atomic<int64_t> widest{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    const int64_t mine = at::get_thread_num() + 1;
    int64_t seen = widest.load();
    while (mine > seen && !widest.compare_exchange_weak(seen, mine)) {
    }
  });
  return widest.load();
}

}  // namespace

// As a torch operator too: the decode step (decode_step_avx2.cpp) calls it from C++.
TORCH_LIBRARY_FRAGMENT(engine, m) { m.def("int8_linear", &linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Dynamic int8 Linear for AVX2 CPUs, bit-identical to fbgemm's (engine.core.int8_avx2)";
  m.def("supported", &supported, "Whether this CPU has AVX2 and FMA (the kernels need both)");
  m.def("threads_in_a_loop", &threads_in_a_loop, "Threads one of the kernel's loops runs on");
  m.def("amx_ready", &amx_int8::ready, "Whether this process may use AMX's int8 tiles here");
  m.def("amx_matmul", &amx_matmul, "codes (m, k) . weight (n, k)^T in int32 on AMX's tiles");
  m.def("pack", &pack, "Pack an int8 (out, in) weight into 8x4 blocks; returns (blocks, rowsum)");
  m.def("linear", &linear, "Dynamic int8 Linear on packed blocks", py::arg("x"), py::arg("packed"),
        py::arg("rowsum"), py::arg("scale"), py::arg("bias"), py::arg("out_features"),
        py::arg("relu"), py::arg("matmul_rows") = 0);
}
