// A decode step's decoder layers run from C++: the CPU counterpart of replaying a CUDA graph.
//
// With 4-bit weights a batch-1 decode step of a small model is ~4 ms of arithmetic, but the
// Python around it (module calls, ~35 ops per layer at 2-5 us of dispatch each) costs more.
// A DecodePlan holds each layer's tensors (norm weights, the four projections: fp32, bf16,
// int4 or FP8) once; `run` then does every layer of one decode step in a single call, with the GIL
// released, through the same kernels and in the same order as the PyTorch modules
// (llmopt/model/llama.py), so its hidden states are bitwise those of the module path.
//
// The step runs in one OpenMP parallel region (csrc/team.h): every thread goes through every layer,
// takes its share of each projection's output rows and of the attention units, and meets the others
// at a spin barrier where the next op needs all of the previous one's output. The small ops on a
// row (the RMSNorms and residual adds) are done by every thread on its own copy of the residual
// stream, so they need no barrier. A kernel per op with a parallel region each forked and joined
// the threads five times a layer (~1.5 us each on 2 threads).
#include <torch/extension.h>
#include <pybind11/stl.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <algorithm>
#include <fstream>
#include <string>
#include <vector>
#include "paged_decode.h"
#include "prefetch.h"
#include "team.h"

void rms_norm_rows(const float* x, int64_t ldx, const float* w, float* out, int64_t n, int64_t h, float eps);
void add_rms_norm_rows(const float* x, int64_t ldx, const float* residual, float* summed, const float* w, float* out,
                       int64_t n, int64_t h, float eps);
void silu_and_mul_rows_f32(const float* x, int64_t ldx, float* out, int64_t ldo, int64_t n, int64_t I, int64_t c0,
                           int64_t c1);
void rotary_rows_(float* xp, int64_t n, int64_t heads, int64_t D, int64_t s0, int64_t s1, const float* cp,
                  const float* sp);
void skinny_linear_check(const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
void skinny_linear_share(const float* x, int64_t M, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                         float* out, int64_t ldo, int64_t share, int64_t shares);
void int4_linear_check(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& zeros,
                       int64_t out_features, int64_t group_size, const c10::optional<torch::Tensor>& perm,
                       const c10::optional<torch::Tensor>& bias);
void int4_linear_share(const float* x, int64_t M, const torch::Tensor& codes, const torch::Tensor& scales,
                       const torch::Tensor& zeros, int64_t out_features, int64_t group_size,
                       const c10::optional<torch::Tensor>& perm, const c10::optional<torch::Tensor>& bias, float* out,
                       int64_t ldo, int64_t share, int64_t shares, const std::vector<WeightRegion>& next,
                       llmopt_prefetch::RowStream* side);
std::vector<WeightRegion> int4_weight_regions(const torch::Tensor& codes, const torch::Tensor& scales,
                                              const torch::Tensor& zeros);
void fp8_linear_check(const torch::Tensor& codes, const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias);
void fp8_linear_share(const float* x, int64_t M, const torch::Tensor& codes, const torch::Tensor& scales,
                      const c10::optional<torch::Tensor>& bias, float* out, int64_t ldo, int64_t share, int64_t shares);

namespace {

using llmopt_team::Team;

// Rows of a decode batch from which the int4 products prefetch the next attention's K/V rows (a
// RowStream, csrc/prefetch.h): with 8 rows and more those products are bound by their arithmetic, and
// the rows come in while the cores compute. The default model, 2 threads, fp32 K/V after 512 tokens
// (scripts/bench_decode_plan.py, old / new build in turn): 8 rows 12.8-13.3 -> 11.6-11.9 ms a step,
// 16 rows 23.9-26.5 -> 20.0-22.2, 24 rows 35.7-37.7 -> 30.4-32.5; at 4 rows no gain (5.9-6.9 ms either
// way), and at 1 row, where the weights stream at the memory's rate, the extra reads slowed a step
// (2.3 -> 2.5 ms).
constexpr int64_t kKvAheadMinRows = 8;

// The rows must still be in cache when the attention reads them, after the weights of the projections
// in between streamed through it: a step prefetches them only where one layer's K/V and those weights
// together fit in the last-level cache (the default model at 24 rows x 512: 19 + 2.3 MB of 32 MB). A
// 1B-shaped model at 8 rows (16.8 MB of K/V and ~32 MB of int4 weights a layer) lost 5% with the rows
// prefetched regardless (45.1-45.5 -> 47.2-47.5 ms); with this check it is level (44.4-44.5 / 44.4-45.2).
int64_t last_level_cache_bytes() {
  static const int64_t bytes = [] {
    int64_t best_level = 0, size = 0;
    for (int index = 0; index < 8; ++index) {  // Linux: each cache's level and size ("32768K")
      const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
      std::ifstream level_file(dir + "level"), size_file(dir + "size");
      int64_t level = 0, value = 0;
      std::string unit;
      if (!(level_file >> level) || !(size_file >> value)) continue;
      size_file >> unit;
      const int64_t scaled = unit == "K" ? value << 10 : unit == "M" ? value << 20 : value;
      if (level > best_level) best_level = level, size = scaled;
    }
    return size > 0 ? size : int64_t{8} << 20;  // 8 MiB where the system does not say
  }();
  return bytes;
}

// One projection as the module path runs it for a decode batch (rows <= the skinny limit):
// fp32 or bf16 weights through skinny_linear, int4 through int4_linear, FP8 through fp8_linear.
struct LinearSpec {
  enum Kind { kDense, kInt4, kFp8 };
  Kind kind = kDense;
  torch::Tensor weight;  // dense fp32 / bf16 [N, K]
  torch::Tensor codes, scales, zeros;  // int4: int4_linear's; FP8: e4m3 codes [N, K] and fp32 scales [N]
  int64_t in_features = 0, out_features = 0, group_size = 0;
  c10::optional<torch::Tensor> perm, bias;

  // the weights as prefetch regions (int4 only: the other kinds' kernels take no `next`)
  std::vector<WeightRegion> regions() const {
    return kind == kInt4 ? int4_weight_regions(codes, scales, zeros) : std::vector<WeightRegion>{};
  }

  // the bytes of its weights a step reads
  int64_t weight_bytes() const {
    const auto bytes = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : int64_t{0}; };
    return bytes(weight) + bytes(codes) + bytes(scales) + bytes(zeros);
  }

  // floats between output rows: int4 computes whole tiles of 8 rows
  int64_t out_stride() const { return kind == kInt4 ? codes.size(0) * 8 : out_features; }

  // this thread's share of y = x @ W.T + bias, x [M, in_features] contiguous, into out [M, out_stride()];
  // `next`: the projection that runs after this one (int4 prefetches the thread's share of it)
  // `side`: rows the int4 kernel prefetches as it computes (the other kinds take none)
  void share(const Team& team, const float* x, int64_t M, float* out, const std::vector<WeightRegion>& next,
             llmopt_prefetch::RowStream* side = nullptr) const {
    switch (kind) {
      case kInt4:
        return int4_linear_share(x, M, codes, scales, zeros, out_features, group_size, perm, bias, out, out_stride(),
                                 team.rank, team.size, next, side);
      case kFp8: return fp8_linear_share(x, M, codes, scales, bias, out, out_stride(), team.rank, team.size);
      default: return skinny_linear_share(x, M, weight, bias, out, out_stride(), team.rank, team.size);
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

// The new token's K and V rows (row r of `k` / `v`, kv_size floats, rows `stride` apart) for rows
// [r0, r1) into a layer's pool [slots, kv heads, head dim] at slots[r]: what index_copy_ of
// k.to(pool dtype) did, without its dispatch; the same conversion (c10's round to nearest even for
// bf16 / fp16).
template <typename T>
void write_kv(void* pool, const float* rows, int64_t stride, int64_t r0, int64_t r1, int64_t kv_size,
              const int64_t* slots) {
  T* base = static_cast<T*>(pool);
  for (int64_t r = r0; r < r1; ++r) {
    T* dst = base + slots[r] * kv_size;
    const float* src = rows + r * stride;
    for (int64_t i = 0; i < kv_size; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

void write_kv_rows(c10::ScalarType dtype, void* pool, const float* rows, int64_t stride, int64_t r0, int64_t r1,
                   int64_t kv_size, const int64_t* slots) {
  switch (dtype) {
    case torch::kFloat32: return write_kv<float>(pool, rows, stride, r0, r1, kv_size, slots);
    case torch::kBFloat16: return write_kv<c10::BFloat16>(pool, rows, stride, r0, r1, kv_size, slots);
    default: return write_kv<c10::Half>(pool, rows, stride, r0, r1, kv_size, slots);
  }
}

class DecodePlan {
 public:
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, double eps, LinearSpec qkv, LinearSpec o,
                 LinearSpec gate_up, LinearSpec down, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t sliding_window, double scale) {
    TORCH_CHECK(input_norm.dtype() == torch::kFloat32 && post_norm.dtype() == torch::kFloat32 &&
                    input_norm.is_contiguous() && post_norm.is_contiguous() && input_norm.dim() == 1 &&
                    post_norm.sizes() == input_norm.sizes(),
                "decode plan: fp32 norm weights [hidden]");
    const int64_t hidden = input_norm.numel(), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0,
                "decode plan: heads a multiple of kv heads, an even head_dim");
    TORCH_CHECK(qkv.in_features == hidden && qkv.out_features == q_size + 2 * kv_size && o.in_features == q_size &&
                    o.out_features == hidden && gate_up.in_features == hidden && gate_up.out_features % 2 == 0 &&
                    down.in_features == gate_up.out_features / 2 && down.out_features == hidden,
                "decode plan: projection shapes do not fit the layer");
    TORCH_CHECK(layers_.empty() || layers_.front().input_norm.numel() == hidden, "decode plan: one hidden size");
    LayerSpec layer{input_norm, post_norm, eps, qkv, o, gate_up, down, num_heads, num_kv_heads, head_dim,
                    sliding_window, scale};
    layer.after_qkv = o.regions();
    layer.after_o = gate_up.regions();
    layer.after_gate_up = down.regions();
    if (!layers_.empty()) layers_.back().after_down = qkv.regions();
    layers_.push_back(std::move(layer));
    // the weights streamed between a layer's K/V prefetch and its attention: the layer before's o, gate_up
    // and down and this layer's qkv (layer 0's come after the last layer's, in the step before)
    kv_window_bytes_ = 0;
    for (size_t i = 0; i < layers_.size(); ++i)
      kv_window_bytes_ = std::max(kv_window_bytes_, layers_[i].o.weight_bytes() + layers_[i].gate_up.weight_bytes() +
                                                        layers_[i].down.weight_bytes() +
                                                        layers_[(i + 1) % layers_.size()].qkv.weight_bytes());
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [n, hidden] (embedded tokens, one per sequence) -> hidden states after the last layer
  // (before the final norm). k_caches / v_caches [layers, slots, kv_heads, head_dim].
  // The module path's residual add (x + mlp(h)) is done by the next layer's input norm
  // (add_rms_norm: residual + x, then the same RMSNorm as rms_norm), the same fp32 operations.
  torch::Tensor run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_caches,
                    torch::Tensor v_caches, torch::Tensor slot_mapping, torch::Tensor block_tables,
                    torch::Tensor context_lens, int64_t block_size) const {
    TORCH_CHECK(!layers_.empty(), "decode plan: no layers");
    const int64_t n = x.size(0), hidden = layers_.front().input_norm.numel();
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == hidden, "decode plan: x fp32 [n, hidden]");
    TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.is_contiguous() && slot_mapping.numel() == n,
                "decode plan: slot_mapping int64 [n]");
    TORCH_CHECK(k_caches.is_contiguous() && v_caches.is_contiguous() && k_caches.sizes() == v_caches.sizes() &&
                    k_caches.dtype() == v_caches.dtype() && k_caches.dim() == 4 &&
                    k_caches.size(0) == num_layers(),
                "decode plan: contiguous K/V pools [layers, slots, kv heads, head dim] of one dtype");
    const c10::ScalarType kv_dtype = k_caches.scalar_type();
    TORCH_CHECK(kv_dtype == torch::kFloat32 || kv_dtype == torch::kBFloat16 || kv_dtype == torch::kFloat16,
                "decode plan: K/V pools must be fp32, bf16 or fp16");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == torch::kFloat32 &&
                    sin.dtype() == torch::kFloat32 && cos.dim() == 2 && cos.size(0) == n && sin.sizes() == cos.sizes(),
                "decode plan: cos, sin fp32 [n, head_dim] contiguous");
    TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64 &&
                    block_tables.dim() == 2 && block_tables.size(0) == n && context_lens.numel() == n,
                "decode plan: int64 block_tables [n, blocks] and context_lens [n]");
    const int64_t num_slots = k_caches.size(1);
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r)
      TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "decode plan: slot ", slots[r], " outside the pool");
    x = x.contiguous();
    const torch::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();

    // shared buffers, each as wide as the widest layer needs
    int64_t qkv_w = 0, q_w = 0, o_w = 0, gu_w = 0, act_w = 0, down_w = 0;
    // attention units: one set per layer shape (kv heads, group, head_dim, window), shared by its layers
    struct Shape {
      int64_t kv_heads, group, head_dim, window;
      bool operator==(const Shape& o) const {
        return kv_heads == o.kv_heads && group == o.group && head_dim == o.head_dim && window == o.window;
      }
    };
    std::vector<Shape> shapes;
    std::vector<PagedDecodeWork> works;
    std::vector<size_t> layer_work(layers_.size());
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerSpec& L = layers_[i];
      TORCH_CHECK(cos.size(1) == L.head_dim, "decode plan: cos, sin of ", cos.size(1), " columns, head_dim ", L.head_dim);
      TORCH_CHECK(k_caches.size(2) == L.num_kv_heads && k_caches.size(3) == L.head_dim,
                  "decode plan: K/V pools do not fit layer ", i);
      qkv_w = std::max(qkv_w, L.qkv.out_stride());
      q_w = std::max(q_w, L.num_heads * L.head_dim);
      o_w = std::max(o_w, L.o.out_stride());
      gu_w = std::max(gu_w, L.gate_up.out_stride());
      act_w = std::max(act_w, L.down.in_features);
      down_w = std::max(down_w, L.down.out_stride());
      const Shape shape{L.num_kv_heads, L.num_heads / L.num_kv_heads, L.head_dim, L.sliding_window};
      const size_t w = std::find(shapes.begin(), shapes.end(), shape) - shapes.begin();
      if (w == shapes.size()) {
        shapes.push_back(shape);
        works.push_back(paged_decode_work(lens.data_ptr<int64_t>(), n, shape.kv_heads, shape.group, shape.head_dim,
                                          shape.window));
      }
      layer_work[i] = w;
    }
    const auto buffer = [&](int64_t width) { return std::vector<float>(n * std::max<int64_t>(width, 1)); };
    std::vector<float> qkv = buffer(qkv_w), attn = buffer(q_w), o_out = buffer(o_w), gu = buffer(gu_w),
                       act = buffer(act_w), mlp = buffer(down_w);
    torch::Tensor out = torch::empty({n, hidden}, x.options());
    const float* x_in = x.data_ptr<float>();
    float* out_p = out.data_ptr<float>();
    const int64_t layer_slots = num_slots * k_caches.size(2) * k_caches.size(3);
    const int64_t element = static_cast<int64_t>(k_caches.element_size());
    char* k_base = static_cast<char*>(k_caches.data_ptr());
    char* v_base = static_cast<char*>(v_caches.data_ptr());
    const float *cos_p = cos.data_ptr<float>(), *sin_p = sin.data_ptr<float>();

    const auto layer_args = [&](size_t i, const float* q, float* attn_out, float scale) {
      return PagedDecodeArgs{q, layers_[i].qkv.out_stride(), k_base + i * layer_slots * element,
                             v_base + i * layer_slots * element, kv_dtype, tables.data_ptr<int64_t>(),
                             tables.size(1), block_size, scale, attn_out};
    };

    // the K/V prefetch's cache budget: a layer's rows, and the weights streamed between their
    // prefetch and their attention (kv_window_bytes_)
    int64_t kv_layer_bytes = 0;
    for (const PagedDecodeWork& work : works)
      if (!work.units.empty())
        kv_layer_bytes = std::max(kv_layer_bytes, 2 * (work.positions_before.back() + work.units.back().n) * work.D *
                                                      element);
    const bool kv_ahead_fits =
        n >= kKvAheadMinRows && kv_layer_bytes + kv_window_bytes_ <= last_level_cache_bytes();

    llmopt_team::Barrier barrier;
    at::internal::lazy_init_num_threads();  // this thread's OpenMP team size: torch's thread count, as at::parallel_for
#pragma omp parallel
    {
      const int64_t size = omp_get_num_threads();
      barrier.set_size(size);
      Team team{omp_get_thread_num(), size, barrier};
      // this thread's copy of the residual stream and of the normed rows
      std::vector<float> residual(x_in, x_in + n * hidden), h(n * hidden);
      const float* pending = nullptr;  // the previous layer's MLP output, not yet added to the residual
      int64_t pending_stride = 0;
      // the K/V rows of this thread's attention units in the layer ahead, prefetched by the int4
      // products before that attention
      llmopt_prefetch::RowStream kv_ahead;
      std::vector<std::vector<int64_t>> kv_rows(works.size());  // per layer shape: the rows' offsets
      llmopt_prefetch::RowStream* const side = kv_ahead_fits ? &kv_ahead : nullptr;
      const auto start_kv_ahead = [&](size_t j) {
        const size_t w = layer_work[j];
        if (kv_rows[w].empty()) {
          const auto [u0, u1] = paged_decode_share(works[w], team.rank, team.size);
          kv_rows[w] = paged_decode_rows(works[w], layer_args(j, nullptr, nullptr, 0.f), u0, u1);
        }
        kv_ahead.first = k_base + j * layer_slots * element;
        kv_ahead.second = v_base + j * layer_slots * element;
        kv_ahead.offsets = kv_rows[w].data();
        kv_ahead.row_bytes = works[w].D * element;
        kv_ahead.next = kv_ahead.within = 0;
        kv_ahead.end = static_cast<int64_t>(kv_rows[w].size());
      };
      if (side != nullptr) start_kv_ahead(0);
      for (size_t i = 0; i < layers_.size(); ++i) {
        const LayerSpec& L = layers_[i];
        const float eps = static_cast<float>(L.eps);
        const int64_t D = L.head_dim, q_size = L.num_heads * D, kv_size = L.num_kv_heads * D;
        // attention block (Attention.forward + PagedAttentionBackend.forward, decode only)
        if (pending != nullptr)
          add_rms_norm_rows(pending, pending_stride, residual.data(), residual.data(), L.input_norm.data_ptr<float>(),
                            h.data(), n, hidden, eps);
        else
          rms_norm_rows(residual.data(), hidden, L.input_norm.data_ptr<float>(), h.data(), n, hidden, eps);
        const int64_t row = L.qkv.out_stride();
        L.qkv.share(team, h.data(), n, qkv.data(), L.after_qkv, side);
        team.sync();
        // rope on q and k in place, the new K/V rows into the pools: this thread's tokens
        const llmopt_team::Range tokens = team.share(n);
        if (tokens.begin < tokens.end) {
          float* first = qkv.data() + tokens.begin * row;
          const int64_t count = tokens.end - tokens.begin;
          rotary_rows_(first, count, L.num_heads, D, row, D, cos_p + tokens.begin * D, sin_p + tokens.begin * D);
          rotary_rows_(first + q_size, count, L.num_kv_heads, D, row, D, cos_p + tokens.begin * D,
                       sin_p + tokens.begin * D);
          write_kv_rows(kv_dtype, k_base + i * layer_slots * element, qkv.data() + q_size, row, tokens.begin,
                        tokens.end, kv_size, slots);
          write_kv_rows(kv_dtype, v_base + i * layer_slots * element, qkv.data() + q_size + kv_size, row,
                        tokens.begin, tokens.end, kv_size, slots);
        }
        team.sync();
        PagedDecodeWork& work = works[layer_work[i]];
        const PagedDecodeArgs args = layer_args(i, qkv.data(), attn.data(), static_cast<float>(L.scale));
        const auto [u0, u1] = paged_decode_share(work, team.rank, team.size);
        paged_decode_units(work, args, u0, u1);
        if (work.partials > 0) {
          team.sync();
          const llmopt_team::Range items = team.share(n * L.num_kv_heads);
          paged_decode_merge(work, attn.data(), items.begin, items.end);
        }
        team.sync();
        if (side != nullptr && i + 1 < layers_.size()) start_kv_ahead(i + 1);
        L.o.share(team, attn.data(), n, o_out.data(), L.after_o, side);
        team.sync();
        // MLP block (DecoderLayer.forward: residual add + norm, then x + mlp(h))
        add_rms_norm_rows(o_out.data(), L.o.out_stride(), residual.data(), residual.data(),
                          L.post_norm.data_ptr<float>(), h.data(), n, hidden, eps);
        L.gate_up.share(team, h.data(), n, gu.data(), L.after_gate_up, side);
        team.sync();
        const int64_t I = L.down.in_features;
        const llmopt_team::Range cols = team.share((I + 7) / 8);  // 8 columns at a time: the vector width
        if (cols.begin < cols.end)
          silu_and_mul_rows_f32(gu.data(), L.gate_up.out_stride(), act.data(), I, n, I, cols.begin * 8,
                                std::min(I, cols.end * 8));
        team.sync();
        L.down.share(team, act.data(), n, mlp.data(), L.after_down, side);
        team.sync();
        pending = mlp.data();
        pending_stride = L.down.out_stride();
      }
      if (team.rank == 0)
        for (int64_t r = 0; r < n; ++r)
          for (int64_t c = 0; c < hidden; ++c)
            out_p[r * hidden + c] = residual[r * hidden + c] + pending[r * pending_stride + c];
    }
    return out;
  }

 private:
  std::vector<LayerSpec> layers_;
  int64_t kv_window_bytes_ = 0;  // the most weight bytes between a layer's K/V prefetch and its attention
};

LinearSpec dense_spec(torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  skinny_linear_check(weight, bias);
  LinearSpec s;
  s.weight = weight;
  s.bias = bias;
  s.in_features = weight.size(1);
  s.out_features = weight.size(0);
  return s;
}

LinearSpec int4_spec(torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros, int64_t out_features,
                     int64_t group_size, c10::optional<torch::Tensor> perm, c10::optional<torch::Tensor> bias) {
  int4_linear_check(codes, scales, zeros, out_features, group_size, perm, bias);
  LinearSpec s;
  s.kind = LinearSpec::kInt4;
  s.in_features = codes.size(1) / 4;  // [N / 8, K * 4]
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
  fp8_linear_check(codes, scales, bias);
  LinearSpec s;
  s.kind = LinearSpec::kFp8;
  s.in_features = codes.size(1);
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
