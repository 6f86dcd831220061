// The Python module of llmopt's CPU kernels (built by kernels/cpu_extension.py).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           int64_t block_size, double scale, int64_t sliding_window);
bool skinny_linear_available();
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
bool fused_ops_available();
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "fp32 paged decode attention");
  m.def("skinny_linear_available", &skinny_linear_available, "built with AVX2 + FMA");
  m.def("skinny_linear", &skinny_linear, "x @ w.T (+ bias) for few rows of x",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("fused_ops_available", &fused_ops_available, "built with AVX2 + FMA");
  m.def("rms_norm", &rms_norm, "w * x / sqrt(mean(x^2) + eps) per row");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual)");
  m.def("rotary_embedding_", &rotary_embedding_, "rope (rotate-half layout) on q and k, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for x = [gate | up]");
}
