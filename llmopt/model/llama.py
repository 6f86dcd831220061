"""Our Llama-family decoder (llama, mistral, qwen2), in plain PyTorch.

Module names mirror Hugging Face's (q/k/v and gate/up are stacked into one matmul each at load). The forward
takes a flat batch of tokens (several sequences packed together) with their absolute
positions, and an `AttentionBackend` that owns the KV cache; this keeps the model free of
any notion of batches, padding or cache layout.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.core.config import ModelConfig
from llmopt.model.attention import AttentionBackend
from llmopt.model.backends import KernelBackend, ReferenceBackend
from llmopt.model.linear import DenseLinear, make_linear
from llmopt.model.ops import REFERENCE_OPS, DecoderOps
from llmopt.model.rope import RotaryEmbedding


# our fused projections and the checkpoint tensors stacked into them (along the output dim)
STACKED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def checkpoint_names(param_name: str) -> list[str]:
    """The checkpoint tensor name(s) a parameter of our model is made of."""
    for fused, parts in STACKED_PROJECTIONS.items():
        if f".{fused}." in param_name:
            return [param_name.replace(fused, part) for part in parts]
    return [param_name]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops: DecoderOps = REFERENCE_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x) as vLLM's
        fused add-RMSNorm."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.sliding_windows[layer_idx] if config.sliding_windows else None
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        # q, k and v in one matmul (checkpoints' q_proj/k_proj/v_proj are stacked at load)
        self.qkv_proj = make_linear(hidden, q_size + 2 * kv_size, config.attention_bias)
        self.o_proj = make_linear(q_size, hidden, config.o_proj_bias)
        self.ops: DecoderOps = REFERENCE_OPS
        self.prompt_math_dtype: torch.dtype | None = None  # set by LlamaForCausalLM.use_fp32_matmul_precision

    def forward(self, x, cos, sin, attn: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary(q, k, cos, sin)
        out = attn.forward(self.layer_idx, q, k, v, self.sliding_window, self.prompt_math_dtype)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.intermediate_size = i
        # gate and up in one matmul (stacked at load from gate_proj/up_proj)
        self.gate_up_proj = make_linear(h, 2 * i, bias)
        self.down_proj = make_linear(i, h, bias)
        self.ops: DecoderOps = REFERENCE_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttentionBackend, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, attn)
        if output_rows is not None:  # the rows wanted from here on: the MLP need not see the others
            h, x = h[output_rows], x[output_rows]
        h, x = self.post_attention_layernorm(h, residual=x)  # x = x + h; h = norm(x)
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # the table comes from the checkpoint: given an uninitialised one, nn.Embedding skips its random init (whose
        # first call imports torch._dynamo, a second or so of every load)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size), _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input rows in the compute dtype: the table may be held in its checkpoint's 16-bit
        dtype beside fp32 layers (an int4 model's, `llmopt.loader`), and the cast is exact."""
        return self.embed_tokens(input_ids).to(self.norm.weight.dtype)

    def forward(self, input_ids, positions, attn: AttentionBackend, output_rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn, output_rows if i == last else None)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder. `forward` returns final hidden states; `compute_logits` the vocab logits.

    Splitting the two lets callers project only the positions they sample from.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = make_linear(config.hidden_size, config.vocab_size, bias=False)
        self.backend: KernelBackend = ReferenceBackend()
        self.ops: DecoderOps = REFERENCE_OPS

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def use_backend(self, backend: KernelBackend, dtype: torch.dtype) -> None:
        """Run on kernel backend `backend` (chosen once at load): its small per-layer ops for
        `dtype` from now on, its paged attention in the model runner."""
        self.backend = backend
        self.ops = ops = backend.decoder_ops(dtype)
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops

    def use_fp32_matmul_precision(self, precision: str) -> bool:
        """What the prompt-sized products of its fp32 layers compute in, the engine's flag ("auto",
        "ieee", "bf16"): the dense layers' through the backend's kernel for it
        (`KernelBackend.fp32_prefill_linear`), and, where that kernel is bf16 math, attention's
        products over prompt-sized chunks in bf16 too where the backend says that pays
        (`KernelBackend.bf16_prompt_attention`; `kernels.paged_attention.attend`). The vocabulary
        projection never takes a kernel that rounds its result to bf16: a logit of 20 would move by up
        to 0.04 nats (measured on the default model: KLD from ieee 5.7e-4 with it, 1.8e-4 without).
        True where some layer takes a kernel."""
        kernel = self.backend.fp32_prefill_linear(precision)
        logits_kernel = self.backend.fp32_prefill_linear(precision, rounded_result=False)
        attention_bf16 = kernel is not None and self.backend.bf16_prompt_attention()
        for m in self.modules():
            if isinstance(m, Attention):
                m.prompt_math_dtype = torch.bfloat16 if attention_bf16 else None
        # products that stay bf16 where their consumer takes them so, bitwise as if widened: gate_up's (silu_and_mul,
        # whose result feeds the down projection), o_proj's (the fused residual add and norm), down_proj's (the
        # residual add, which widens it)
        bf16_results = {id(m.down_proj) for m in self.modules() if isinstance(m, MLP)}
        if self.ops.silu_and_mul_takes_bf16:
            bf16_results |= {id(m.gate_up_proj) for m in self.modules() if isinstance(m, MLP)}
        if self.ops.add_rms_norm_takes_bf16:
            bf16_results |= {id(m.o_proj) for m in self.modules() if isinstance(m, Attention)}
        dense = [m for m in self.modules() if isinstance(m, DenseLinear)]
        return any([m.use_prefill_kernel(logits_kernel if m is self.lm_head else kernel,
                                         bf16_result=id(m) in bf16_results) for m in dense])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]; with `output_rows`
        (indices), the states of those rows only, in that order (every row's K/V still goes through every layer,
        but the last layer's MLP runs on those rows alone)."""
        return self.model(input_ids, positions, attn, output_rows)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
