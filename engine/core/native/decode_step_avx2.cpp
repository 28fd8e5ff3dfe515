// An LM's decode step (one new position of one sequence) through all of its layers in one call.
//
// Why: around its matrix products a decode step is about twenty small operators a layer (norms,
// rotary positions or position biases, the cache write, attention, residual adds, SwiGLU), and
// dispatched one by one from Python they cost a CosyVoice2 int4 step about two thirds of the
// time of its products, much of it in the Python interpreter itself. Here the same operators
// run in the same order from C++: the engine's kernels through torch's dispatcher (each kernel
// module registers its functions as ``engine::`` operators) and torch's own operators for the
// rest, so the results are bit for bit those of the Python paths (engine.cosyvoice2.qwen2,
// engine.core.transformer). The GIL is released for the whole step.
//
// The module has no kernels of its own; ``supported()`` says whether the kernels it calls run.

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace {

bool supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

using Int8LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const c10::optional<at::Tensor>&, int64_t,
                                bool, int64_t);
using Int4LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&,
                                const c10::optional<at::Tensor>&, int64_t, int64_t);
using RmsNormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                               const c10::optional<at::Tensor>&, const std::vector<at::Tensor>&);

template <typename Fn>
c10::TypedOperatorHandle<Fn> engine_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// One of the LM's quantised Linear layers, as its Python module holds it (a decode row never
// reaches the many-row GEMM path, so none is passed).
class Linear {
 public:
  virtual ~Linear() = default;
  virtual at::Tensor operator()(const at::Tensor& x) const = 0;
};

class Int8Linear : public Linear {
 public:
  Int8Linear(at::Tensor blocks, at::Tensor rowsum, at::Tensor scale,
             c10::optional<at::Tensor> bias, int64_t out_features, bool relu)
      : op_(engine_op<Int8LinearFn>("engine::int8_linear")),
        blocks_(std::move(blocks)),
        rowsum_(std::move(rowsum)),
        scale_(std::move(scale)),
        bias_(std::move(bias)),
        out_features_(out_features),
        relu_(relu) {}

  at::Tensor operator()(const at::Tensor& x) const override {
    return op_.call(x, blocks_, rowsum_, scale_, bias_, out_features_, relu_, 0);
  }

 private:
  c10::TypedOperatorHandle<Int8LinearFn> op_;
  at::Tensor blocks_, rowsum_, scale_;
  c10::optional<at::Tensor> bias_;
  int64_t out_features_;
  bool relu_;
};

class Int4Linear : public Linear {
 public:
  Int4Linear(at::Tensor packed, c10::optional<at::Tensor> bias, int64_t out_features)
      : op_(engine_op<Int4LinearFn>("engine::int4_linear")),
        packed_(std::move(packed)),
        bias_(std::move(bias)),
        out_features_(out_features) {}

  at::Tensor operator()(const at::Tensor& x) const override {
    return op_.call(x, packed_, bias_, out_features_, 0);
  }

 private:
  c10::TypedOperatorHandle<Int4LinearFn> op_;
  at::Tensor packed_;
  c10::optional<at::Tensor> bias_;
  int64_t out_features_;
};

// A Qwen2 decoder layer's weights: its two RMS norms' and its four (fused) Linear layers.
struct Qwen2Layer {
  at::Tensor input_norm, post_attention_norm;
  std::shared_ptr<Linear> qkv, o, gate_up, down;
};

// The decoder layers of engine.cosyvoice2.qwen2.Qwen2Model, for its single-sequence decode step.
class Qwen2Layers {
 public:
  Qwen2Layers(std::vector<Qwen2Layer> layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
              double eps)
      : layers_(std::move(layers)),
        heads_(heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(1.0 / std::sqrt(static_cast<double>(head_dim))),
        norm_(engine_op<RmsNormFn>("engine::rms_norm")),
        attention_(engine_op<AttentionFn>("engine::decode_attention")) {
    TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  }

  // x (1, 1, d) at position ``start`` -> the last layer's output (1, 1, d), not normed; each
  // layer's K/V written to ``kv`` (layers, 2, 1, kv_heads, max_len, head_dim) at ``start``.
  // cos, sin (head_dim,): the position's rows of qwen2.rotary_rows.
  at::Tensor step(const at::Tensor& x_in, const at::Tensor& kv_cache, int64_t start,
                  const at::Tensor& cos, const at::Tensor& sin) const {
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == static_cast<int64_t>(layers_.size()) &&
                    kv_cache.size(2) == 1 && kv_cache.size(3) == kv_heads_ &&
                    kv_cache.size(5) == head_dim_,
                "kv: (layers, 2, 1, kv_heads, max_len, head_dim) of this model");
    TORCH_CHECK(start >= 0 && start < kv_cache.size(4), "position ", start, " outside the cache");
    pybind11::gil_scoped_release no_gil;
    const int64_t length = start + 1;
    const int64_t q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
    const at::Tensor kv = kv_cache.select(2, 0);  // (layers, 2, kv_heads, max_len, hd)
    at::Tensor x = x_in.clone();                  // the layers add to it in place
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Qwen2Layer& layer = layers_[i];
      const at::Tensor layer_kv = kv.select(0, static_cast<int64_t>(i));
      // attention: q and k rotated in place, k and v into the cache's slot, then one head
      // group per K/V head against the cache up to and including this position
      const at::Tensor qkv = (*layer.qkv)(norm_.call(x, layer.input_norm, eps_)).view({-1});
      at::Tensor qk = qkv.narrow(0, 0, q_dim + kv_dim).view({-1, head_dim_});
      const at::Tensor turned = qk.roll({head_dim_ / 2}, {-1}).mul_(sin);
      at::add_out(qk, turned, qk * cos);
      const at::Tensor new_kv = qkv.narrow(0, q_dim, 2 * kv_dim).view({2, kv_heads_, head_dim_});
      layer_kv.select(2, start).copy_(new_kv);
      const at::Tensor q =
          qkv.narrow(0, 0, q_dim).view({kv_heads_, heads_ / kv_heads_, head_dim_});
      const at::Tensor keys = layer_kv.select(0, 0).narrow(1, 0, length);
      const at::Tensor values = layer_kv.select(0, 1).narrow(1, 0, length);
      const at::Tensor heads_out = attention_.call(q, keys, values, scale_, c10::nullopt, {});
      x.add_((*layer.o)(heads_out.view({1, 1, -1})));
      // SwiGLU feed-forward: silu(gate) * up, in place in the product's fresh output
      const at::Tensor gate_up = (*layer.gate_up)(norm_.call(x, layer.post_attention_norm, eps_));
      std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
      x.add_((*layer.down)(at::silu_(halves[0]).mul_(halves[1])));
    }
    return x;
  }

 private:
  std::vector<Qwen2Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  c10::TypedOperatorHandle<RmsNormFn> norm_;
  c10::TypedOperatorHandle<AttentionFn> attention_;
};

// A CosyVoice-300M LM layer's weights (engine.core.transformer.EncoderLayer): its two
// LayerNorms', pos_bias_u and pos_bias_v stacked (2, h, d_k), its four Linear layers (q/k/v
// fused) and whether the first feed-forward layer applies the ReLU itself.
struct RelPosLayer {
  at::Tensor norm_a_weight, norm_a_bias, norm_b_weight, norm_b_bias, uv_biases;
  std::shared_ptr<Linear> qkv, out, w_1, w_2;
  bool w_1_relu;
};

// Per layer, blocks of ``block`` rows each; every layer has at least ``count`` of them.
struct PositionRows {
  std::vector<std::vector<at::Tensor>> blocks;
  int64_t block, count;
  int64_t positions() const { return block * count; }
};

// The layers of engine.core.transformer.RelPosEncoder (relative positions, pre-LN, ReLU
// feed-forward), for its single-sequence decode step.
class RelPosLayers {
 public:
  RelPosLayers(std::vector<RelPosLayer> layers, int64_t heads, int64_t head_dim, double eps)
      : layers_(std::move(layers)),
        heads_(heads),
        head_dim_(head_dim),
        eps_(eps),
        scale_(1.0 / std::sqrt(static_cast<double>(head_dim))),
        attention_(engine_op<AttentionFn>("engine::decode_attention")) {}

  // Each layer's positional rows, blocks of ``block`` relative positions in position order
  // (RelPosAttention._row_blocks). Only ever grows: steps of other answers may be reading the
  // rows held now (each takes the set it starts with).
  void hold_position_blocks(std::vector<std::vector<at::Tensor>> blocks, int64_t block) {
    TORCH_CHECK(blocks.size() == layers_.size(), "one list of blocks per layer");
    TORCH_CHECK(block > 0, "blocks of at least one row");
    int64_t count = INT64_MAX;
    for (const auto& layer_blocks : blocks) {
      count = std::min(count, static_cast<int64_t>(layer_blocks.size()));
    }
    auto held =
        std::make_shared<const PositionRows>(PositionRows{std::move(blocks), block, count});
    std::lock_guard<std::mutex> lock(mutex_);
    if (rows_ == nullptr || held->positions() > rows_->positions()) rows_ = std::move(held);
  }

  // How many positions the rows held cover.
  int64_t positions_held() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return rows_ == nullptr ? 0 : rows_->positions();
  }

  // x (1, 1, d) at position ``start`` (after the input layer) -> the last layer's output.
  at::Tensor step(const at::Tensor& x_in, const at::Tensor& kv_cache, int64_t start) const {
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == static_cast<int64_t>(layers_.size()) &&
                    kv_cache.size(2) == 1 && kv_cache.size(3) == heads_ &&
                    kv_cache.size(5) == head_dim_,
                "kv: (layers, 2, 1, heads, max_len, head_dim) of this model");
    TORCH_CHECK(start >= 0 && start < kv_cache.size(4), "position ", start, " outside the cache");
    const int64_t length = start + 1;
    std::shared_ptr<const PositionRows> rows;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      rows = rows_;
    }
    TORCH_CHECK(rows != nullptr && rows->positions() >= length, "positional rows for ", length,
                " positions not held");
    const int64_t block = rows->block, count = (length + block - 1) / block;
    pybind11::gil_scoped_release no_gil;
    const int64_t d = heads_ * head_dim_;
    const at::Tensor kv = kv_cache.select(2, 0);  // (layers, 2, h, max_len, d_k)
    at::Tensor x = x_in;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const RelPosLayer& layer = layers_[i];
      const at::Tensor layer_kv = kv.select(0, static_cast<int64_t>(i));
      const at::Tensor h = at::layer_norm(x, {d}, layer.norm_a_weight, layer.norm_a_bias, eps_);
      const at::Tensor qkv = (*layer.qkv)(h).view({3, heads_, head_dim_});
      layer_kv.select(2, start).copy_(qkv.narrow(0, 1, 2));
      const std::vector<at::Tensor> uv =
          (qkv.select(0, 0) + layer.uv_biases).view({2, heads_, 1, head_dim_}).unbind(0);
      // the rows of relative positions L-1 ... 0: the blocks they fall in, highest first, the
      // first cut to the positions used
      std::vector<at::Tensor> pieces;
      for (int64_t b = count - 1; b >= 0; --b) pieces.push_back(rows->blocks[i][b]);
      pieces[0] = pieces[0].narrow(1, count * block - length, length - (count - 1) * block);
      const at::Tensor keys = layer_kv.select(0, 0).narrow(1, 0, length);
      const at::Tensor values = layer_kv.select(0, 1).narrow(1, 0, length);
      const at::Tensor heads_out = attention_.call(uv[0], keys, values, scale_,
                                                   uv[1].reshape({heads_, head_dim_}), pieces);
      x = x + (*layer.out)(heads_out.view({1, 1, d}));
      const at::Tensor h2 = at::layer_norm(x, {d}, layer.norm_b_weight, layer.norm_b_bias, eps_);
      at::Tensor hidden = (*layer.w_1)(h2);
      if (!layer.w_1_relu) hidden = at::relu(hidden);
      x = x + (*layer.w_2)(hidden);
    }
    return x;
  }

 private:
  std::vector<RelPosLayer> layers_;
  int64_t heads_, head_dim_;
  double eps_, scale_;
  c10::TypedOperatorHandle<AttentionFn> attention_;
  mutable std::mutex mutex_;
  std::shared_ptr<const PositionRows> rows_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "An LM's decode step through all of its layers in one call (engine.core.decode_step)";
  m.def("supported", &supported, "Whether this CPU runs the kernels the step calls (AVX2, FMA)");
  py::class_<Linear, std::shared_ptr<Linear>>(m, "Linear");
  py::class_<Int8Linear, Linear, std::shared_ptr<Int8Linear>>(m, "Int8Linear")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, c10::optional<at::Tensor>, int64_t,
                    bool>(),
           py::arg("blocks"), py::arg("rowsum"), py::arg("scale"), py::arg("bias"),
           py::arg("out_features"), py::arg("relu"));
  py::class_<Int4Linear, Linear, std::shared_ptr<Int4Linear>>(m, "Int4Linear")
      .def(py::init<at::Tensor, c10::optional<at::Tensor>, int64_t>(), py::arg("packed"),
           py::arg("bias"), py::arg("out_features"));
  py::class_<Qwen2Layer>(m, "Qwen2Layer")
      .def(py::init<at::Tensor, at::Tensor, std::shared_ptr<Linear>, std::shared_ptr<Linear>,
                    std::shared_ptr<Linear>, std::shared_ptr<Linear>>(),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("qkv"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"));
  py::class_<Qwen2Layers>(m, "Qwen2Layers")
      .def(py::init<std::vector<Qwen2Layer>, int64_t, int64_t, int64_t, double>(),
           py::arg("layers"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("eps"))
      .def("step", &Qwen2Layers::step, py::arg("x"), py::arg("kv"), py::arg("start"),
           py::arg("cos"), py::arg("sin"));
  py::class_<RelPosLayer>(m, "RelPosLayer")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                    std::shared_ptr<Linear>, std::shared_ptr<Linear>, std::shared_ptr<Linear>,
                    std::shared_ptr<Linear>, bool>(),
           py::arg("norm_a_weight"), py::arg("norm_a_bias"), py::arg("norm_b_weight"),
           py::arg("norm_b_bias"), py::arg("uv_biases"), py::arg("qkv"), py::arg("out"),
           py::arg("w_1"), py::arg("w_2"), py::arg("w_1_relu"));
  py::class_<RelPosLayers>(m, "RelPosLayers")
      .def(py::init<std::vector<RelPosLayer>, int64_t, int64_t, double>(), py::arg("layers"),
           py::arg("heads"), py::arg("head_dim"), py::arg("eps"))
      .def("hold_position_blocks", &RelPosLayers::hold_position_blocks, py::arg("blocks"),
           py::arg("block"))
      .def("positions_held", &RelPosLayers::positions_held)
      .def("step", &RelPosLayers::step, py::arg("x"), py::arg("kv"), py::arg("start"));
}
