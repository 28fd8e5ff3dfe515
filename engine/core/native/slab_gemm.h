// Shared by the engine's int8 and int4 Linear kernels (int8_avx2.cpp, int4_avx2.cpp): a
// many-row call's integer GEMM, a slab of output blocks (8 channels each) at a time, each slab's
// weight read back from the layer's blocks into a buffer small enough to stay in L2. The sums
// come from AMX's tiles where this process may use them and the inputs are whole tile rows
// (amx_int8.h: the slab's weight then in tile order), else from oneDNN's int8 GEMM (plain rows).

#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_int8.h"

class SlabGemm {
 public:
  static constexpr int64_t kBlockChannels = 8;

  // ``rows`` activation rows of ``in`` inputs against ``blocks`` output blocks, about
  // ``slab_bytes`` of int8 weight a slab.
  SlabGemm(int64_t in, int64_t rows, int64_t blocks, int64_t slab_bytes)
      : amx(in % amx_int8::kDepth == 0 && amx_int8::ready()), in_(in), rows_(rows) {
    slab = std::max<int64_t>(1, slab_bytes / (in * kBlockChannels));
    if (amx) slab = std::max<int64_t>(4, slab / 4 * 4);  // whole pairs of 16-channel tiles
    // A small layer: a buffer no larger than its weight (in whole tile pairs on AMX).
    slab = std::min(slab, amx ? (blocks + 3) / 4 * 4 : blocks);
    // AMX reads whole pairs of 16-row tiles: rows past the last are zeros.
    padded_ = amx ? amx_int8::pairs(rows) * amx_int8::kPair : rows;
  }

  const bool amx;  // the slab's weight in AMX's tile order, else plain int8 rows
  int64_t slab;    // output blocks a slab

  // Room for the activation codes (``rows`` x ``in``, int8), the padding rows zeros.
  at::Tensor codes() const {
    at::Tensor codes = at::empty({padded_, in_}, at::kChar);
    std::memset(codes.data_ptr<int8_t>() + rows_ * in_, 0,
                static_cast<size_t>((padded_ - rows_) * in_));
    return codes;
  }

  // Room for one slab's weight.
  at::Tensor weight() const { return at::empty({slab * kBlockChannels, in_}, at::kChar); }

  // Before a slab of ``n`` blocks is written: a last tile pair's missing channels are zeros.
  void clear(const at::Tensor& weight, int64_t n) const {
    if (amx && n % 4 != 0)
      std::memset(weight.data_ptr<int8_t>(), 0, static_cast<size_t>(weight.numel()));
  }

  // The sums of ``codes`` against a slab of ``n`` blocks: int32, a row per activation row
  // (and padding), ``size(1)`` apart, the slab's channels first.
  at::Tensor sums(const at::Tensor& codes, const at::Tensor& weight, int64_t n) const {
    if (!amx) return at::_int_mm(codes, weight.narrow(0, 0, n * kBlockChannels).t());
    const int64_t pairs = amx_int8::pairs(n * kBlockChannels);
    at::Tensor acc = at::empty({padded_, pairs * amx_int8::kPair}, at::kInt);
    amx_int8::sums(codes.data_ptr<int8_t>(), rows_, in_, weight.data_ptr<int8_t>(), pairs,
                   acc.data_ptr<int32_t>());
    return acc;
  }

 private:
  int64_t in_, rows_, padded_;
};
