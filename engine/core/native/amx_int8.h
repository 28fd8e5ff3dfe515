// Shared by the engine's int8 and int4 Linear kernels (int8_avx2.cpp, int4_avx2.cpp): the
// integer sums of their many-row calls (a prompt's prefill) on AMX, the tile registers of
// Intel's server CPUs since Sapphire Rapids.
//
// Why not oneDNN's int8 GEMM there: the engine caps oneDNN below AMX wherever the int8 HiFT
// runs (its AMX convolutions compile a kernel for every new length: engine.core.runtime), and
// on AVX-512 VNNI the GEMM computes a prefill at about half the rate these tiles do. The sums
// are exact int32 either way, so the layers' outputs are the same bit for bit.
//
// Layout: the activations are the left operand, read in place (16 rows x 64 inputs a tile);
// the weight is the right one, laid out by the caller in "tile order": per 16 output channels
// and 64 inputs a 1 KB tile whose row ``q`` holds inputs 4q..4q+3 of each of the 16 channels
// (the 4-byte groups the dot-product instruction reads), 8 channels a 32-byte half. A tile
// product is then 16 rows x 16 channels of the output, stored in place.

#pragma once

#include <ATen/Parallel.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx_int8 {

constexpr int64_t kTile = 16;              // rows of a tile: activation rows or output channels
constexpr int64_t kDepth = 64;             // int8 inputs in a tile row
constexpr int64_t kTileBytes = kTile * kDepth;
constexpr int64_t kPair = 2 * kTile;       // rows and channels come two tiles at a time

// Whether this CPU has AMX's int8 tiles and Linux lets this process use them: a process asks
// for the tile state once (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first
// tile instruction faults.
inline bool ready() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if ((d & (1u << 24)) == 0 || (d & (1u << 25)) == 0) return false;  // AMX-TILE, AMX-INT8
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

// A multiple of whole tile pairs (the padded rows and channels of a call).
inline int64_t pairs(int64_t n) { return (n + kPair - 1) / kPair; }

// Byte offset of inputs 4q..4q+3 of output channel ``c`` in a weight in tile order ``in``
// inputs wide: column(c, in) + quad(q) (apart: a channel's column is computed once, not per
// 4 inputs).
inline int64_t column(int64_t c, int64_t in) {
  return c / kTile * (in / kDepth) * kTileBytes + c % kTile * 4;
}
inline int64_t quad(int64_t q) { return q / kTile * kTileBytes + q % kTile * kDepth; }

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Channel pairs [p0, p1) of ``out`` on this thread: tiles 0-3 the sums, 4-5 two activation
// tiles, 6-7 two weight tiles.
__attribute__((target("amx-tile,amx-int8"))) inline void sum_pairs(
    const int8_t* x, int64_t row_pairs, int64_t in, const int8_t* weight, int64_t p0,
    int64_t p1, int32_t* out, int64_t width) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = kDepth;
    config.rows[t] = kTile;
  }
  _tile_loadconfig(&config);
  const int64_t steps = in / kDepth, stride = width * 4;
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* w0 = weight + 2 * p * steps * kTileBytes;
    const int8_t* w1 = w0 + steps * kTileBytes;
    for (int64_t r = 0; r < row_pairs; ++r) {
      const int8_t* x0 = x + r * kPair * in;
      const int8_t* x1 = x0 + kTile * in;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(4, x0 + s * kDepth, in);
        _tile_loadd(5, x1 + s * kDepth, in);
        _tile_loadd(6, w0 + s * kTileBytes, kDepth);
        _tile_loadd(7, w1 + s * kTileBytes, kDepth);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
      int32_t* c = out + r * kPair * width + p * kPair;
      _tile_stored(0, c, stride);
      _tile_stored(1, c + kTile, stride);
      _tile_stored(2, c + kTile * width, stride);
      _tile_stored(3, c + kTile * width + kTile, stride);
    }
  }
  _tile_release();
}

// out (pairs(rows) * 32 x channel_pairs * 32, int32) = x . weight^T: ``x`` int8 rows x ``in``
// with its rows padded to whole pairs (zeros), ``weight`` in tile order, ``in`` a multiple of
// 64. Only where ready().
inline void sums(const int8_t* x, int64_t rows, int64_t in, const int8_t* weight,
                 int64_t channel_pairs, int32_t* out) {
  const int64_t row_pairs = pairs(rows), width = channel_pairs * kPair;
  at::parallel_for(0, channel_pairs, 1, [&](int64_t p0, int64_t p1) {
    sum_pairs(x, row_pairs, in, weight, p0, p1, out, width);
  });
}

}  // namespace amx_int8
