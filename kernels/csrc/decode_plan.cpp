// A decode step's decoder layers run from C++: the CPU counterpart of replaying a CUDA graph.
//
// With 4-bit weights a batch-1 decode step of a small model is ~4 ms of arithmetic, but the
// Python around it (module calls, ~35 ops per layer at 2-5 us of dispatch each) costs more.
// A DecodePlan holds each layer's tensors (norm weights, the four projections: fp32, bf16,
// int4 or FP8) once; `run` then does every layer of one decode step in a single call, with the GIL
// released, through the same kernels and in the same order as the PyTorch modules
// (llmopt/model/llama.py), so its hidden states are bitwise those of the module path.
#include <torch/extension.h>
#include <pybind11/stl.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <vector>
#include "prefetch.h"

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, int64_t block_size, double scale, int64_t sliding_window);
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
void rotary_rows_(float* xp, int64_t n, int64_t heads, int64_t D, int64_t s0, int64_t s1, const float* cp,
                  const float* sp);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor int4_linear_next(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                               int64_t out_features, int64_t group_size, c10::optional<torch::Tensor> perm,
                               c10::optional<torch::Tensor> bias, const std::vector<WeightRegion>& next);
std::vector<WeightRegion> int4_weight_regions(const torch::Tensor& codes, const torch::Tensor& scales,
                                              const torch::Tensor& zeros);
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> bias);

namespace {

// One projection as the module path runs it for a decode batch (rows <= the skinny limit):
// fp32 or bf16 weights through skinny_linear, int4 through int4_linear, FP8 through fp8_linear.
struct LinearSpec {
  enum Kind { kDense, kInt4, kFp8 };
  Kind kind = kDense;
  torch::Tensor weight;  // dense fp32 / bf16 [N, K]
  torch::Tensor codes, scales, zeros;  // int4: int4_linear's; FP8: e4m3 codes [N, K] and fp32 scales [N]
  int64_t out_features = 0, group_size = 0;
  c10::optional<torch::Tensor> perm, bias;

  // the weights as prefetch regions (int4 only: the other kinds' kernels take no `next`)
  std::vector<WeightRegion> regions() const {
    return kind == kInt4 ? int4_weight_regions(codes, scales, zeros) : std::vector<WeightRegion>{};
  }

  // `next`: the projection that runs after this one (int4 kernels prefetch each thread's share of it)
  torch::Tensor operator()(const torch::Tensor& x, const std::vector<WeightRegion>& next = {}) const {
    switch (kind) {
      case kInt4: return int4_linear_next(x, codes, scales, zeros, out_features, group_size, perm, bias, next);
      case kFp8: return fp8_linear(x, codes, scales, bias);
      default: return skinny_linear(x, weight, bias);
    }
  }
};

struct LayerSpec {
  torch::Tensor input_norm, post_norm;
  double eps;
  LinearSpec qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim, sliding_window;  // sliding_window -1: none
  double scale;  // the attention scale, as the module path computes it (head_dim ** -0.5)
  // prefetch regions of the projection after each of qkv, o, gate_up, down (down: the next layer's qkv)
  std::vector<WeightRegion> after_qkv, after_o, after_gate_up, after_down;
};

// The new token's K and V rows (row r of `k` / `v`, kv_size floats, rows `stride` apart) into layer
// `layer` of the pools [layers, slots, kv heads, head dim] at slot_mapping[r]: what index_copy_ of
// k.to(pool dtype) did, without its dispatch (~8 us a layer); the same conversion (c10's round to
// nearest even for bf16 / fp16).
template <typename T>
void write_kv(torch::Tensor& pool, int64_t layer, const float* rows, int64_t stride, int64_t n, int64_t kv_size,
              const int64_t* slots) {
  const int64_t num_slots = pool.size(1);
  T* base = pool.data_ptr<T>() + layer * num_slots * kv_size;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "decode plan: slot ", slots[r], " outside the pool");
    T* dst = base + slots[r] * kv_size;
    const float* src = rows + r * stride;
    for (int64_t i = 0; i < kv_size; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

void write_kv_rows(torch::Tensor& pool, int64_t layer, const float* rows, int64_t stride, int64_t n, int64_t kv_size,
                   const int64_t* slots) {
  switch (pool.scalar_type()) {
    case torch::kFloat32: return write_kv<float>(pool, layer, rows, stride, n, kv_size, slots);
    case torch::kBFloat16: return write_kv<c10::BFloat16>(pool, layer, rows, stride, n, kv_size, slots);
    case torch::kFloat16: return write_kv<c10::Half>(pool, layer, rows, stride, n, kv_size, slots);
    default: TORCH_CHECK(false, "decode plan: K/V pools must be fp32, bf16 or fp16");
  }
}

class DecodePlan {
 public:
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, double eps, LinearSpec qkv, LinearSpec o,
                 LinearSpec gate_up, LinearSpec down, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t sliding_window, double scale) {
    LayerSpec layer{input_norm, post_norm, eps, qkv, o, gate_up, down, num_heads, num_kv_heads, head_dim,
                    sliding_window, scale};
    layer.after_qkv = o.regions();
    layer.after_o = gate_up.regions();
    layer.after_gate_up = down.regions();
    if (!layers_.empty()) layers_.back().after_down = qkv.regions();
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [n, hidden] (embedded tokens, one per sequence) -> hidden states after the last layer
  // (before the final norm). k_caches / v_caches [layers, slots, kv_heads, head_dim].
  // The module path's residual add (x + mlp(h)) is done by the next layer's input norm
  // (add_rms_norm: residual + x, then the same RMSNorm as rms_norm), the same fp32 operations.
  torch::Tensor run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_caches,
                    torch::Tensor v_caches, torch::Tensor slot_mapping, torch::Tensor block_tables,
                    torch::Tensor context_lens, int64_t block_size) const {
    const int64_t n = x.size(0);
    TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.is_contiguous() && slot_mapping.numel() == n,
                "decode plan: slot_mapping int64 [n]");
    TORCH_CHECK(k_caches.is_contiguous() && v_caches.is_contiguous(), "decode plan: contiguous K/V pools");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == torch::kFloat32 &&
                    sin.dtype() == torch::kFloat32 && cos.dim() == 2 && cos.size(0) == n && sin.sizes() == cos.sizes(),
                "decode plan: cos, sin fp32 [n, head_dim] contiguous");
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    x = x.contiguous();
    torch::Tensor mlp_out;  // the previous layer's MLP output, not yet added to x
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerSpec& L = layers_[i];
      const int64_t q_size = L.num_heads * L.head_dim, kv_size = L.num_kv_heads * L.head_dim;
      TORCH_CHECK(cos.size(1) == L.head_dim, "decode plan: cos, sin of ", cos.size(1), " columns, head_dim ", L.head_dim);
      // attention block (Attention.forward + PagedAttentionBackend.forward, decode only)
      torch::Tensor h;
      if (mlp_out.defined()) {
        std::vector<torch::Tensor> normed = add_rms_norm(mlp_out, x, L.input_norm, L.eps);
        h = normed[0];
        x = normed[1];
      } else {
        h = rms_norm(x, L.input_norm, L.eps);
      }
      torch::Tensor qkv = L.qkv(h, L.after_qkv);
      float* qkv_p = qkv.data_ptr<float>();
      const int64_t row = qkv.size(1);
      rotary_rows_(qkv_p, n, L.num_heads, L.head_dim, row, L.head_dim, cos.data_ptr<float>(), sin.data_ptr<float>());
      rotary_rows_(qkv_p + q_size, n, L.num_kv_heads, L.head_dim, row, L.head_dim, cos.data_ptr<float>(),
                   sin.data_ptr<float>());
      write_kv_rows(k_caches, i, qkv_p + q_size, row, n, kv_size, slots);
      write_kv_rows(v_caches, i, qkv_p + q_size + kv_size, row, n, kv_size, slots);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({n, L.num_heads, L.head_dim}).contiguous();
      torch::Tensor attn = paged_decode(q, k_caches.select(0, i), v_caches.select(0, i), block_tables, context_lens,
                                        block_size, L.scale, L.sliding_window);
      h = L.o(attn.view({n, q_size}), L.after_o);
      // MLP block (DecoderLayer.forward: residual add + norm, then x + mlp(h))
      std::vector<torch::Tensor> normed = add_rms_norm(h, x, L.post_norm, L.eps);
      x = normed[1];
      mlp_out = L.down(silu_and_mul(L.gate_up(normed[0], L.after_gate_up)), L.after_down);
    }
    return mlp_out.defined() ? x + mlp_out : x;
  }

 private:
  std::vector<LayerSpec> layers_;
};

LinearSpec dense_spec(torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == torch::kFloat32 || weight.scalar_type() == torch::kBFloat16),
              "dense_linear: contiguous fp32 or bf16 weight [N, K]");
  LinearSpec s;
  s.weight = weight;
  s.bias = bias;
  s.out_features = weight.size(0);
  return s;
}

LinearSpec int4_spec(torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, int64_t out_features,
                     int64_t group_size, c10::optional<torch::Tensor> perm, c10::optional<torch::Tensor> bias) {
  LinearSpec s;
  s.kind = LinearSpec::kInt4;
  s.codes = codes;
  s.scales = scales;
  s.zeros = zeros;
  s.out_features = out_features;
  s.group_size = group_size;
  s.perm = perm;
  s.bias = bias;
  return s;
}

LinearSpec fp8_spec(torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kUInt8 &&
                  scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == codes.size(0),
              "fp8_linear: contiguous e4m3 codes [N, K] as uint8 and fp32 scales [N]");
  LinearSpec s;
  s.kind = LinearSpec::kFp8;
  s.codes = codes;
  s.scales = scales;
  s.bias = bias;
  s.out_features = codes.size(0);
  return s;
}

}  // namespace

void register_decode_plan(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<LinearSpec>(m, "LinearSpec");
  m.def("dense_linear_spec", &dense_spec, "a projection with fp32 / bf16 weights (skinny_linear)",
        py::arg("weight"), py::arg("bias") = py::none());
  m.def("int4_linear_spec", &int4_spec, "a projection with int4 weights (int4_linear's arguments)",
        py::arg("codes"), py::arg("scales"), py::arg("zeros"), py::arg("out_features"), py::arg("group_size"),
        py::arg("perm") = py::none(), py::arg("bias") = py::none());
  m.def("fp8_linear_spec", &fp8_spec, "a projection with FP8 e4m3 weights (fp8_linear's arguments)",
        py::arg("codes"), py::arg("scales"), py::arg("bias") = py::none());
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("num_layers", &DecodePlan::num_layers)
      .def("run", &DecodePlan::run, py::call_guard<py::gil_scoped_release>());
}
