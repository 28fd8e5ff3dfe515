// Group-wise int4 Linear for x86 CPUs with AVX2: the LM's 4-bit format (engine/core/int4.py)
// with a weight layout made for the decode step, where one row of activations meets every
// weight once per token.
//
// Why: torch's int4 CPU kernel is vectorised for AVX2 but computes in bfloat16 and is 2-6x
// slower than the int8 kernels there although it reads half the bytes (docs/dev/int4.md). Here
// the 4-bit codes meet int8 activations in vpmaddubsw, as the int8 kernel's do, and each group's
// scale is applied once per group of 32 inputs.
//
// The maths (w4a8): a weight is scale_w * (u - 8), u the stored code 0..15, one bfloat16 scale
// per output channel and group of 32 inputs. Each activation row is quantised per group of 32
// to symmetric int8: x ~ scale_x * q, scale_x = max|x| / 127, q = round(x / scale_x).
//   y = sum over groups of (scale_w * scale_x) * sum_k (u_k - 8) q_k, + bias.
// vpmaddubsw takes the unsigned codes u (not u - 8) against the signed q; the -8 * sum(q) of
// each group is the sums' starting value (a constant of the row, the same for every channel).
// Every partial sum stays inside int16: each term (u - 8) q is within 8 * 127, 16 terms a lane.
//
// Layout: blocks of 8 output channels; per block and group 144 bytes: 128 of codes (4 x 32
// bytes, each register one nibble per channel and input for 8 inputs: byte 4c + j holds
// input 8p + j of channel c in its low nibble and input 8p + 4 + j in its high one), then the
// 8 channels' bfloat16 scales. A block's groups follow each other: one sequential stream.
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

constexpr int64_t kRows = 8;         // output channels per block (one register of sums)
constexpr int64_t kGroup = 32;       // inputs per scale (engine.core.int4.GROUP_SIZE)
constexpr int64_t kCodeBytes = kRows * kGroup / 2;           // 128
constexpr int64_t kGroupBytes = kCodeBytes + kRows * 2;      // + 8 bfloat16 scales = 144
constexpr int kStreams = 4;          // blocks walked side by side at one activation row
constexpr int kRowGroup = 4;         // activation rows computed together against one unpack
constexpr int64_t kTileBytes = 192 * 1024;  // weight bytes kept hot in L2 across row groups
constexpr int64_t kSlabBytes = 1024 * 1024;  // int8 weight bytes per GEMM of many rows

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// One activation row quantised per group: codes, each group's scale and its sums' start.
struct QuantRows {
  std::vector<int8_t> codes;     // rows x in
  std::vector<float> scale;      // rows x groups
  std::vector<int32_t> start;    // rows x groups: -8 * the pair sums as two int16 (see above)
};

inline float max_abs8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

void quantize_rows(const float* x, int64_t rows, int64_t in, QuantRows* q) {
  const int64_t groups = in / kGroup;
  q->codes.resize(static_cast<size_t>(rows * in));
  q->scale.resize(static_cast<size_t>(rows * groups));
  q->start.resize(static_cast<size_t>(rows * groups));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < rows * groups; ++i) {
    const float* xg = x + i * kGroup;
    __m256 v[4], peak = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xg + 8 * j);
      peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, v[j]));
    }
    const float amax = max_abs8(peak);
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    q->scale[i] = amax / 127.f;
    const __m256 vinv = _mm256_set1_ps(inverse);
    __m256i c[4];
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
    // int32 -> int8 (values within +-127): packs keep 128-bit lanes, so reorder afterwards.
    const __m256i w01 = _mm256_packs_epi32(c[0], c[1]);
    const __m256i w23 = _mm256_packs_epi32(c[2], c[3]);
    __m256i b = _mm256_packs_epi16(w01, w23);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q->codes.data() + i * kGroup), b);
    // Pair sums of the group: even lanes inputs 4k, 4k+1; odd lanes 4k+2, 4k+3.
    alignas(32) int8_t t[kGroup];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), b);
    int32_t even = 0, odd = 0;
    for (int k = 0; k < kGroup; k += 4) {
      even += t[k] + t[k + 1];
      odd += t[k + 2] + t[k + 3];
    }
    const uint32_t lo = static_cast<uint16_t>(static_cast<int16_t>(-8 * even));
    const uint32_t hi = static_cast<uint16_t>(static_cast<int16_t>(-8 * odd));
    q->start[i] = static_cast<int32_t>(lo | (hi << 16));
  }
}

struct Layer {
  const uint8_t* weight;  // packed blocks
  const float* bias;      // per output channel, padded to whole blocks, or null
  int64_t in_features, out_features;
};

inline __m256i broadcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm256_set1_epi32(v);
}

// The 8 channels' scales of one group: bfloat16 is the top half of a float32.
inline __m256 group_scales(const uint8_t* w) {
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kCodeBytes));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(s), 16));
}

inline void store(const Layer& layer, int64_t block, __m256 acc, float* y) {
  const int64_t n0 = block * kRows;
  if (layer.bias != nullptr) acc = _mm256_add_ps(acc, _mm256_loadu_ps(layer.bias + n0));
  store_block(y, n0, layer.out_features, acc);
}

// R activation rows, their groups interleaved: group g of row r at codes + (g * R + r) * 32,
// its scale and starting sum at index g * R + r (one pointer walks all R rows).
struct Rows {
  const int8_t* codes;
  const int32_t* start;
  const float* scale;
};

// S blocks (one per stream) against R activation rows, written to y's rows row0...
// Each 32-byte load of codes is unpacked once and meets every row; each broadcast of 4 inputs
// meets every block.
template <int S, int R>
inline void micro(const Layer& layer, Rows x, int64_t row0, const int64_t* blocks, float* y) {
  const int64_t in = layer.in_features, groups = in / kGroup;
  const int64_t stride = groups * kGroupBytes;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* w[S];
  __m256 acc[S][R];
  for (int s = 0; s < S; ++s) {
    w[s] = layer.weight + blocks[s] * stride;
    for (int r = 0; r < R; ++r) acc[s][r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sums[S][R];
    for (int r = 0; r < R; ++r) {
      const __m256i start = _mm256_set1_epi32(x.start[g * R + r]);
      for (int s = 0; s < S; ++s) sums[s][r] = start;
    }
    for (int p = 0; p < 4; ++p) {
      for (int s = 0; s < S; ++s) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w[s] + g * kGroupBytes + 32 * p));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          // Broadcast where used: a load each, and no register held across the rows.
          const int8_t* xr = x.codes + (g * R + r) * kGroup + 8 * p;
          sums[s][r] = _mm256_add_epi16(sums[s][r], _mm256_maddubs_epi16(lo, broadcast4(xr)));
          sums[s][r] = _mm256_add_epi16(sums[s][r], _mm256_maddubs_epi16(hi, broadcast4(xr + 4)));
          // Keep the running sum in its register: without this GCC reorders the (associative)
          // integer adds into a tree over all products of the group and spills them.
          asm("" : "+x"(sums[s][r]));
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const __m256 ws = group_scales(w[s] + g * kGroupBytes);
      for (int r = 0; r < R; ++r) {
        const __m256 scale = _mm256_mul_ps(ws, _mm256_set1_ps(x.scale[g * R + r]));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[s][r], ones));
        acc[s][r] = _mm256_fmadd_ps(dot, scale, acc[s][r]);
      }
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) store(layer, blocks[s], acc[s][r], y + (row0 + r) * layer.out_features);
}

// One activation row against blocks [b0, b1): the range is cut into kStreams parts walked side
// by side, so that the prefetchers keep several sequential reads in flight.
void one_row(const Layer& layer, const QuantRows& q, int64_t b0, int64_t b1, float* y) {
  const Rows x{q.codes.data(), q.start.data(), q.scale.data()};
  const int64_t per_stream = (b1 - b0) / kStreams;
  for (int64_t i = 0; i < per_stream; ++i) {
    int64_t blocks[kStreams];
    for (int s = 0; s < kStreams; ++s) blocks[s] = b0 + s * per_stream + i;
    micro<kStreams, 1>(layer, x, 0, blocks, y);
  }
  for (int64_t b = b0 + kStreams * per_stream; b < b1; ++b) micro<1, 1>(layer, x, 0, &b, y);
}

// The rows' activations reordered so that each group of kRowGroup rows (the last may be
// fewer) has its groups interleaved (Rows): row group m starts at row m * kRowGroup.
QuantRows interleave_row_groups(const QuantRows& q, int64_t rows, int64_t groups) {
  QuantRows out;
  out.codes.resize(q.codes.size());
  out.start.resize(q.start.size());
  out.scale.resize(q.scale.size());
  for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
    const int64_t n = std::min<int64_t>(kRowGroup, rows - r0);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = 0; r < n; ++r) {
        const int64_t from = (r0 + r) * groups + g, to = r0 * groups + g * n + r;
        std::memcpy(out.codes.data() + to * kGroup, q.codes.data() + from * kGroup, kGroup);
        out.start[to] = q.start[from];
        out.scale[to] = q.scale[from];
      }
  }
  return out;
}

// Every activation row (``q`` as interleave_row_groups leaves it) against blocks [b0, b1), a
// tile of blocks at a time so that the tile's weights stay in L2 while every row group passes
// over them.
void many_rows(const Layer& layer, const QuantRows& q, int64_t rows, int64_t b0, int64_t b1,
               float* y) {
  const int64_t groups = layer.in_features / kGroup;
  const int64_t tile = std::max<int64_t>(1, kTileBytes / (groups * kGroupBytes));
  for (int64_t t0 = b0; t0 < b1; t0 += tile) {
    const int64_t t1 = std::min(b1, t0 + tile);
    for (int64_t m = 0; m < rows; m += kRowGroup) {
      const Rows x{q.codes.data() + m * groups * kGroup, q.start.data() + m * groups,
                   q.scale.data() + m * groups};
      for (int64_t b = t0; b < t1; ++b) {
        switch (std::min<int64_t>(kRowGroup, rows - m)) {
          case 4: micro<1, 4>(layer, x, m, &b, y); break;
          case 3: micro<1, 3>(layer, x, m, &b, y); break;
          case 2: micro<1, 2>(layer, x, m, &b, y); break;
          default: micro<1, 1>(layer, x, m, &b, y); break;
        }
      }
    }
  }
}

// --- many rows on an int8 GEMM -------------------------------------------------------------
//
// A prompt's prefill is bound by the products, not by reading the weights. Where an int8 GEMM
// sums exactly (VNNI, AMX: engine.core.int8_avx2) a call of many rows takes per-channel
// int8 weights and per-row int8 activations (KleidiAI's activations on Arm): each channel's
// 4-bit weights requantised to int8 over the channel (w8 = round((u - 8) * s_group /
// s_channel), s_channel = 8 * max |s_group| / 127, so |w8| <= 127), each activation row
// quantised symmetrically (q = round(x * 127 / max |x|)), y = acc * (s_channel * s_row) + bias.
// A slab of channels at a time, in L2.

// Blocks [b0, b1) requantised into ``dst`` (block ``first``'s channels first) as plain int8
// rows, 8 a block, or in AMX's tile order (``tiled``: amx_int8.h), each channel's scale into
// ``scale`` (from block ``first``'s first channel on).
void requantize_blocks(const Layer& layer, int64_t b0, int64_t b1, int64_t first, bool tiled,
                       int8_t* dst, float* scale) {
  const int64_t in = layer.in_features, groups = in / kGroup, stride = groups * kGroupBytes;
  const __m256i low = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi32(8);
  const __m256i byte = _mm256_set1_epi32(0xFF);
  const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* w = layer.weight + b * stride;
    __m256 peak = zero;
    for (int64_t g = 0; g < groups; ++g)
      peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, group_scales(w + g * kGroupBytes)));
    const __m256 channel_scale = _mm256_mul_ps(peak, _mm256_set1_ps(8.0f / 127.0f));
    // 1 / channel_scale; 0 for a channel of zero weights (scale 0, codes 8)
    const __m256 inverse = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), channel_scale),
                                         _mm256_cmp_ps(peak, zero, _CMP_GT_OQ));
    _mm256_storeu_ps(scale + (b - first) * kRows, channel_scale);
    int8_t* rows = dst + (b - first) * kRows * in;
    int8_t* column = dst + (tiled ? amx_int8::column((b - first) * kRows, in) : 0);
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 ratio = _mm256_mul_ps(group_scales(w + g * kGroupBytes), inverse);
      __m256i words[8];  // lo / hi nibbles of each 32-byte part: inputs 8p..8p+3, 8p+4..8p+7
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kGroupBytes + 32 * p));
        for (int half = 0; half < 2; ++half) {
          const __m256i codes = half ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low)
                                     : _mm256_and_si256(v, low);
          __m256i packed = _mm256_setzero_si256();
          for (int j = 0; j < 4; ++j) {
            const __m256i u = _mm256_and_si256(_mm256_srli_epi32(codes, 8 * j), byte);
            const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, eight)), ratio);
            const __m256i q = _mm256_cvtps_epi32(f);  // half to even
            packed = _mm256_or_si256(packed, _mm256_slli_epi32(_mm256_and_si256(q, byte), 8 * j));
          }
          words[2 * p + half] = packed;
        }
      }
      if (tiled) {  // words[q]: inputs 4q..4q+3 of the group, each channel's in turn
        for (int q = 0; q < 8; ++q)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(column + amx_int8::quad(g * 8 + q)),
                              words[q]);
        continue;
      }
      transpose8x8_epi32(words);  // words[c]: channel c's 32 inputs in order
      for (int c = 0; c < kRows; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + c * in + g * kGroup), words[c]);
    }
  }
}

// Rows [r0, r1) of x (``in`` wide) quantised symmetrically to int8, each with its scale.
void quantize_rows_whole(const float* x, int64_t r0, int64_t r1, int64_t in, int8_t* codes,
                         float* scales) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * in;
    __m256 peak = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; k += 8)
      peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k)));
    const float amax = max_abs8(peak);
    scales[r] = amax / 127.f;
    const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int64_t k = 0; k < in; k += 8) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), inverse));
      alignas(32) int32_t t[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(t), q);
      for (int j = 0; j < 8; ++j) codes[r * in + k + j] = static_cast<int8_t>(t[j]);
    }
  }
}

// Rows [r0, r1) of blocks [b0, b1) from their sums (a row of ``width`` from block b0 on).
void finish_rows(const Layer& layer, const int32_t* acc, int64_t width, const float* scale,
                 const float* row_scales, int64_t b0, int64_t b1, int64_t r0, int64_t r1,
                 float* y) {
  for (int64_t r = r0; r < r1; ++r) {
    const __m256 row_scale = _mm256_set1_ps(row_scales[r]);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i = (b - b0) * kRows;
      const __m256 sums = _mm256_cvtepi32_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * width + i)));
      const __m256 both = _mm256_mul_ps(_mm256_loadu_ps(scale + i), row_scale);
      const __m256 out = layer.bias != nullptr
                             ? _mm256_fmadd_ps(sums, both, _mm256_loadu_ps(layer.bias + b * kRows))
                             : _mm256_mul_ps(sums, both);
      store_block(y + r * layer.out_features, b * kRows, layer.out_features, out);
    }
  }
}

#pragma GCC pop_options

// All rows of x against the layer by integer GEMM, a slab of output blocks at a time
// (slab_gemm.h): each slab's weight requantised for the GEMM, its sums read by the epilogue
// while they are in L2.
void gemm_rows(const Layer& layer, const float* x, int64_t rows, float* y) {
  const int64_t in = layer.in_features;
  const int64_t blocks = (layer.out_features + kRows - 1) / kRows;
  const SlabGemm gemm(in, rows, blocks, kSlabBytes);
  const at::Tensor codes = gemm.codes();
  std::vector<float> row_scales(static_cast<size_t>(rows));
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    quantize_rows_whole(x, r0, r1, in, codes.data_ptr<int8_t>(), row_scales.data());
  });
  const at::Tensor weight = gemm.weight();
  std::vector<float> scale(static_cast<size_t>(gemm.slab * kRows));
  for (int64_t s0 = 0; s0 < blocks; s0 += gemm.slab) {
    const int64_t n = std::min(gemm.slab, blocks - s0);
    gemm.clear(weight, n);
    at::parallel_for(s0, s0 + n, 4, [&](int64_t b0, int64_t b1) {
      requantize_blocks(layer, b0, b1, s0, gemm.amx, weight.data_ptr<int8_t>(), scale.data());
    });
    const at::Tensor acc = gemm.sums(codes, weight, n);
    const int32_t* ap = acc.data_ptr<int32_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      finish_rows(layer, ap, acc.size(1), scale.data(), row_scales.data(), s0, s0 + n, r0, r1, y);
    });
  }
}

// --- the Python surface ----------------------------------------------------------------------

// codes (out x in/2, uint8: two codes a byte, the even input's in the low nibble) and scales
// (out x in/32, bfloat16) -> the packed blocks (uint8), channels padded with code 8 and scale 0.
at::Tensor pack(const at::Tensor& codes_in, const at::Tensor& scales_in) {
  TORCH_CHECK(codes_in.scalar_type() == at::kByte && codes_in.dim() == 2,
              "uint8 codes of shape (out, in / 2)");
  TORCH_CHECK(scales_in.scalar_type() == at::kBFloat16 && scales_in.dim() == 2,
              "bfloat16 scales of shape (out, in / 32)");
  const at::Tensor codes = codes_in.contiguous(), scales = scales_in.contiguous();
  const int64_t out = codes.size(0), in = 2 * codes.size(1);
  TORCH_CHECK(in % kGroup == 0, "in_features must be a multiple of ", kGroup);
  TORCH_CHECK(scales.size(0) == out && scales.size(1) == in / kGroup,
              "one scale per output channel and group of ", kGroup);
  const int64_t blocks = (out + kRows - 1) / kRows, groups = in / kGroup;
  at::Tensor packed = at::zeros({blocks * groups * kGroupBytes}, at::kByte);
  const uint8_t* src = codes.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  auto code = [&](int64_t n, int64_t k) -> uint8_t {
    if (n >= out) return 8;  // a padding channel: weight 0
    const uint8_t byte = src[n * (in / 2) + k / 2];
    return (k % 2) ? byte >> 4 : byte & 0x0F;
  };
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* block = dst + (b * groups + g) * kGroupBytes;
      for (int64_t p = 0; p < 4; ++p)
        for (int64_t c = 0; c < kRows; ++c)
          for (int64_t j = 0; j < 4; ++j) {
            const int64_t n = b * kRows + c, k = g * kGroup + 8 * p + j;
            block[32 * p + 4 * c + j] = static_cast<uint8_t>(code(n, k) | (code(n, k + 4) << 4));
          }
      uint16_t* s = reinterpret_cast<uint16_t*>(block + kCodeBytes);
      for (int64_t c = 0; c < kRows; ++c) {
        const int64_t n = b * kRows + c;
        s[c] = n < out ? sc[n * groups + g] : 0;
      }
    }
  }
  return packed;
}

// x (..., in; float32) -> (..., out; float32).
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t out_features,
                  int64_t matmul_rows) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1, "float32 (..., in)");
  const at::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const int64_t in = x.size(-1), rows = in > 0 ? x.numel() / in : 0;
  TORCH_CHECK(in % kGroup == 0, "in_features must be a multiple of ", kGroup);
  const int64_t blocks = (out_features + kRows - 1) / kRows;
  TORCH_CHECK(packed.numel() == blocks * (in / kGroup) * kGroupBytes,
              "packed weight does not match the input");
  TORCH_CHECK(!bias || bias->numel() == blocks * kRows, "bias padded to whole blocks");
  const Layer layer{packed.data_ptr<uint8_t>(), bias ? bias->data_ptr<float>() : nullptr, in,
                    out_features};
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = at::empty(out_shape, x.options());
  if (rows == 0) return y;

  float* yp = y.data_ptr<float>();
  if (matmul_rows > 0 && rows >= matmul_rows) {
    gemm_rows(layer, x.data_ptr<float>(), rows, yp);
    return y;
  }
  QuantRows q;
  quantize_rows(x.data_ptr<float>(), rows, in, &q);
  if (rows == 1) {
    at::parallel_for(0, blocks, kStreams * 4, [&](int64_t b0, int64_t b1) {
      one_row(layer, q, b0, b1, yp);
    });
  } else {
    const QuantRows interleaved = interleave_row_groups(q, rows, in / kGroup);
    at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
      many_rows(layer, interleaved, rows, b0, b1, yp);
    });
  }
  return y;
}

// The activations as the kernel quantises them, for the tests: (codes int8 (rows, in),
// scales float32 (rows, in / 32)).
std::vector<at::Tensor> quantize_activations(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "float32 (rows, in)");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(in % kGroup == 0, "in_features must be a multiple of ", kGroup);
  QuantRows q;
  quantize_rows(x.data_ptr<float>(), rows, in, &q);
  at::Tensor codes = at::empty({rows, in}, at::kChar);
  at::Tensor scales = at::empty({rows, in / kGroup}, at::kFloat);
  std::memcpy(codes.data_ptr<int8_t>(), q.codes.data(), q.codes.size());
  std::memcpy(scales.data_ptr<float>(), q.scale.data(), q.scale.size() * sizeof(float));
  return {codes, scales};
}

}  // namespace

// As a torch operator too: the decode step (decode_step_avx2.cpp) calls it from C++.
TORCH_LIBRARY_FRAGMENT(engine, m) { m.def("int4_linear", &linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Group-wise int4 Linear for AVX2 CPUs, int8 activations (engine.core.int4)";
  m.def("supported", &supported, "Whether this CPU has AVX2 and FMA (the kernels need both)");
  m.def("pack", &pack, "Pack int4 codes and bfloat16 group scales into 8-channel blocks");
  m.def("linear", &linear, "Int4 Linear on packed blocks", py::arg("x"), py::arg("packed"),
        py::arg("bias"), py::arg("out_features"), py::arg("matmul_rows") = 0);
  m.def("quantize_activations", &quantize_activations,
        "The int8 codes and per-group scales the kernel computes an activation row with");
}
