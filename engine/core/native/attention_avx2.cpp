// The attention of one new position of one sequence (an LM's decode step) for x86 CPUs with
// AVX2: softmax(scale * q.K + [qp.P]) . V per query head, in one call.
//
// Why: at a decode step the query is one row per head. torch runs its scores and weighted sum
// as batched matrix products with one column (bmm), which its BLAS computes at a few GFLOP/s:
// on the AVX-512 Zen 4 host the CosyVoice-300M LM's three products per layer took about 60 us
// each, 2.6 ms of a 13 ms token, for work that reads about 1.6 MB per layer. Here each row
// of K, V (and P) is read once per query, with the dot products four rows at a time.
//
// q (H, G, D): G query heads share the key/value head h (grouped-query attention; G = 1
// otherwise). keys, values (H, L, D): the cache up to and including the new position, rows
// contiguous. CosyVoice-300M's relative positions add qp[h] . P[h, l], where P is the layer's
// pre-scaled positional rows given as consecutive pieces (H, n_i, D) with sum n_i = L.
// The softmax is torch's (at::_softmax over the scores), so only the two products'
// summation order differs from the bmm path: results agree to float32 rounding. Head sizes:
// multiples of 8 up to 128 (the released models' is 64; the tiny test models' smaller, so that
// the parity tests run through this kernel too).
//
// The kernel is compiled for AVX2 and FMA only (the pragma below), the module itself for any
// x86-64: it imports on every x86-64 CPU, and ``supported()`` says whether it may run.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace {

bool supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// A piece of the positional rows P: its first row of head 0, the floats between its heads and
// between its rows, and its number of rows.
struct Rows {
  const float* base;
  int64_t head_stride;
  int64_t row_stride;
  int64_t rows;
};

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// The sums of the 8 lanes of a, b, c and d, in that order.
inline __m128 four_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b);
  const __m256 cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline float one_sum(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// out[l] = factor * (query . row l) + out[l] (add) or the product alone, for n rows.
template <int D8>
void row_dots(const float* query, const float* rows, int64_t row_stride, int64_t n, float factor,
              bool add, float* out) {
  __m256 qv[D8];
  for (int j = 0; j < D8; ++j) qv[j] = _mm256_loadu_ps(query + 8 * j);
  const __m128 f4 = _mm_set1_ps(factor);
  int64_t l = 0;
  for (; l + 4 <= n; l += 4) {
    const float* r = rows + l * row_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int j = 0; j < D8; ++j) {
      a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(r + 8 * j), a0);
      a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(r + row_stride + 8 * j), a1);
      a2 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(r + 2 * row_stride + 8 * j), a2);
      a3 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(r + 3 * row_stride + 8 * j), a3);
    }
    __m128 s = _mm_mul_ps(four_sums(a0, a1, a2, a3), f4);
    if (add) s = _mm_add_ps(s, _mm_loadu_ps(out + l));
    _mm_storeu_ps(out + l, s);
  }
  for (; l < n; ++l) {
    const float* r = rows + l * row_stride;
    __m256 a = _mm256_setzero_ps();
    for (int j = 0; j < D8; ++j) a = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(r + 8 * j), a);
    const float s = factor * one_sum(a);
    out[l] = add ? s + out[l] : s;
  }
}

// out = sum over l of weights[l] * values row l.
template <int D8>
void weighted_rows(const float* weights, const float* values, int64_t row_stride, int64_t n,
                   float* out) {
  __m256 acc[D8];
  for (int j = 0; j < D8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t l = 0; l < n; ++l) {
    const __m256 w = _mm256_set1_ps(weights[l]);
    const float* r = values + l * row_stride;
    for (int j = 0; j < D8; ++j) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * j), acc[j]);
  }
  for (int j = 0; j < D8; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

template <int D8>
void score(const float* q, const float* k, int64_t heads, int64_t group, int64_t length,
           int64_t k_head, int64_t k_row, float scale, const float* qp,
           const std::vector<Rows>& pieces, float* scores) {
  constexpr int64_t D = 8 * D8;
  // Scores, with the positional term first so that it is added as the bmm path adds it.
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores + (h * group + g) * length;
        bool add = false;
        if (qp != nullptr) {
          int64_t at = 0;
          for (const Rows& piece : pieces) {
            row_dots<D8>(qp + h * D, piece.base + h * piece.head_stride, piece.row_stride,
                         piece.rows, 1.0f, false, row + at);
            at += piece.rows;
          }
          add = true;
        }
        row_dots<D8>(q + (h * group + g) * D, k + h * k_head, k_row, length, scale, add, row);
      }
    }
  });
}

template <int D8>
void combine(const float* probs, const float* v, int64_t heads, int64_t group, int64_t length,
             int64_t v_head, int64_t v_row, float* out) {
  constexpr int64_t D = 8 * D8;
  at::parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        weighted_rows<D8>(probs + (h * group + g) * length, v + h * v_head, v_row, length,
                          out + (h * group + g) * D);
      }
    }
  });
}

#pragma GCC pop_options

// Head sizes are compiled in, 8 floats a block, so that a row's blocks stay in registers.
constexpr int kMaxBlocks = 16;

template <int D8 = 1, typename Run>
void dispatch_blocks(int blocks, Run& run) {
  if constexpr (D8 <= kMaxBlocks) {
    if (blocks == D8) {
      run(std::integral_constant<int, D8>{});
    } else {
      dispatch_blocks<D8 + 1>(blocks, run);
    }
  }
}

void check_rows(const at::Tensor& t, const char* what, int64_t heads, int64_t d) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 3, what, ": float32 (H, L, D)");
  TORCH_CHECK(t.size(0) == heads && t.size(2) == d, what, ": (H, L, D) of the query's H and D");
  TORCH_CHECK(t.stride(2) == 1, what, ": its rows must be contiguous");
}

// q (H, G, D), keys and values (H, L, D) -> (H, G, D); pos_query (H, D) with pos_rows pieces
// (H, n_i, D), sum n_i = L, or None and no pieces.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& keys,
                            const at::Tensor& values, double scale,
                            const c10::optional<at::Tensor>& pos_query,
                            const std::vector<at::Tensor>& pos_rows) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && q_in.dim() == 3, "q: float32 (H, G, D)");
  const at::Tensor q = q_in.contiguous();
  const int64_t heads = q.size(0), group = q.size(1), d = q.size(2);
  TORCH_CHECK(d % 8 == 0 && d >= 8 && d <= 8 * kMaxBlocks, "head size a multiple of 8 up to ",
              8 * kMaxBlocks);
  check_rows(keys, "keys", heads, d);
  check_rows(values, "values", heads, d);
  const int64_t length = keys.size(1);
  TORCH_CHECK(values.size(1) == length && length > 0, "keys and values: the same L > 0");
  at::Tensor qp;
  std::vector<Rows> pieces;
  if (pos_query.has_value()) {
    qp = pos_query->contiguous();
    TORCH_CHECK(qp.scalar_type() == at::kFloat && qp.numel() == heads * d,
                "pos_query: float32 (H, D)");
    TORCH_CHECK(!pos_rows.empty(), "pos_query needs its positional rows");
    int64_t total = 0;
    for (const auto& piece : pos_rows) {
      check_rows(piece, "pos_rows", heads, d);
      pieces.push_back({piece.data_ptr<float>(), piece.stride(0), piece.stride(1), piece.size(1)});
      total += piece.size(1);
    }
    TORCH_CHECK(total == length, "pos_rows: ", total, " rows for ", length, " positions");
  } else {
    TORCH_CHECK(pos_rows.empty(), "pos_rows need a pos_query");
  }
  at::Tensor scores = at::empty({heads * group, length}, q.options());
  at::Tensor out = at::empty({heads, group, d}, q.options());
  const float* qpp = qp.defined() ? qp.data_ptr<float>() : nullptr;
  auto run = [&](auto d8) {
    constexpr int D8 = decltype(d8)::value;
    score<D8>(q.data_ptr<float>(), keys.data_ptr<float>(), heads, group, length, keys.stride(0),
              keys.stride(1), static_cast<float>(scale), qpp, pieces, scores.data_ptr<float>());
    const at::Tensor probs = at::_softmax(scores, 1, false);
    combine<D8>(probs.data_ptr<float>(), values.data_ptr<float>(), heads, group, length,
                values.stride(0), values.stride(1), out.data_ptr<float>());
  };
  dispatch_blocks(d / 8, run);
  return out;
}

}  // namespace

// As a torch operator too: the decode step (decode_step_avx2.cpp) calls it from C++.
TORCH_LIBRARY_FRAGMENT(engine, m) { m.def("decode_attention", &decode_attention); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "An LM decode step's attention in one call for AVX2 CPUs (engine.core.decode_attention)";
  m.def("supported", &supported, "Whether this CPU has AVX2 and FMA (the kernel needs both)");
  m.def("decode_attention", &decode_attention,
        "softmax(scale * q.K + [pos_query.P]) . V for one position: (H, G, D)", py::arg("q"),
        py::arg("keys"), py::arg("values"), py::arg("scale"), py::arg("pos_query") = py::none(),
        py::arg("pos_rows") = std::vector<at::Tensor>{});
}
