// The Python module of llmopt's CPU kernels (built by kernels/cpu_extension.py).
#include <torch/extension.h>
#include "isa.h"

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           int64_t block_size, double scale, int64_t sliding_window);
torch::Tensor paged_decode_share_rows(torch::Tensor context_lens, torch::Tensor block_tables, int64_t block_size,
                                      int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t sliding_window,
                                      c10::ScalarType dtype, int64_t share, int64_t shares);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor segments,
                                double scale, int64_t sliding_window, bool bf16_products);
bool bf16_products_available();
bool skinny_linear_available();
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
bool fused_ops_available();
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);
bool int4_linear_simd();
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                          int64_t out_features, int64_t group_size, c10::optional<torch::Tensor> perm,
                          c10::optional<torch::Tensor> bias);

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features);
bool fp8_linear_simd();
std::string fp8_linear_path();
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> bias);
void register_decode_plan(pybind11::module& m);
torch::Tensor fake_quant_error(torch::Tensor w, torch::Tensor col_scale, torch::Tensor limit, int64_t width,
                               int64_t max_code, bool sym);

// The heavy kernels release the GIL: a server's event loop keeps running during a step.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode", &paged_decode, release_gil(), "paged decode attention: fp32 q and output, fp32/bf16/fp16 K/V");
  m.def("paged_decode_share_rows", &paged_decode_share_rows,
        "the pool byte offsets of the K/V rows one thread's share of a decode step's attention reads, in its order "
        "(what the decode plan prefetches)");
  m.def("prefill_attention", &prefill_attention, release_gil(),
        "prompt attention of packed sequences, each after an optional run of visible context keys: fp32 in and out, "
        "the products in fp32 or (bf16_products) bf16",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("segments"), pybind11::arg("scale"),
        pybind11::arg("sliding_window"), pybind11::arg("bf16_products") = false);
  m.def("bf16_products_available", &bf16_products_available,
        "prefill_attention's bf16 products run here now (AVX512-BF16 built and present, the AVX-512 path active)");
  m.def("skinny_linear_available", &skinny_linear_available, "built with AVX2 + FMA");
  m.def("skinny_linear", &skinny_linear, release_gil(), "x @ w.T (+ bias) for few rows of x",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("fused_ops_available", &fused_ops_available, "built with AVX2 + FMA");
  m.def("rms_norm", &rms_norm, "w * x / sqrt(mean(x^2) + eps) per row");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual)");
  m.def("rotary_embedding_", &rotary_embedding_, "rope (rotate-half layout) on q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]");
  m.def("int4_linear_simd", &int4_linear_simd, "int4_linear built with AVX2 + FMA (else portable C++)");
  m.def("int4_linear", &int4_linear, release_gil(), "x @ dequant(W).T (+ bias): 4-bit W, int8-quantized x per 32 values",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("zeros"),
        pybind11::arg("out_features"), pybind11::arg("group_size"), pybind11::arg("perm") = pybind11::none(), pybind11::arg("bias") = pybind11::none());
  m.def("int8_linear", &int8_linear, release_gil(), "x @ dequant(W).T: 8-bit W per 32 columns, int8-quantized x",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("out_features"));
  m.def("fake_quant_error", &fake_quant_error, release_gil(),
        "group-wise rounding error of clamp(w * col_scale, +-limit), divided by col_scale (AWQ's searches)");
  m.def("fp8_linear_simd", &fp8_linear_simd, "fp8_linear takes a SIMD path now (AVX2 + F16C or AVX-512; else a table)");
  m.def("fp8_linear_path", &fp8_linear_path, "the path fp8_linear takes now: scalar, avx2 or avx512");
  m.def("fp8_linear", &fp8_linear, release_gil(), "x @ (codes * scale).T (+ bias): e4m3 W widened in registers",
        pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("bias") = pybind11::none());
  m.def("cpu_isa", [] { return std::string(llmopt_isa::isa_name(llmopt_isa::active_isa())); },
        "the SIMD path the kernels take now: scalar, avx2, avx512 or amx");
  m.def("cpu_isa_supported", [] { return std::string(llmopt_isa::isa_name(llmopt_isa::cpu_supported_isa())); },
        "the widest path this build and this CPU allow");
  m.def("set_cpu_isa", [](const std::string& name) {
          const int isa = llmopt_isa::isa_from_name(name);
          TORCH_CHECK(isa >= 0, "unknown CPU path '", name, "' (scalar, avx2, avx512, amx)");
          const int previous = llmopt_isa::isa_cap().exchange(isa);
          return std::string(llmopt_isa::isa_name(previous));
        }, "cap the kernels' SIMD path (tests); returns the previous cap");
  register_decode_plan(m);
}
