"""Every compile-time variant of llmopt's Triton kernels, and their compilation for a GPU that is
not here.

`enumerate_variants` lists the (kernel, argument types, constexprs) combinations the launchers can
launch, built with the launchers' own functions (`write_kv_meta`, `decode_meta`, `merge_meta`, `prefill_meta`,
`gemv_meta`, `gemm_meta`, `dequant_meta`, `_block_k`, `SPLIT_CHOICES`, `SPLIT_K_CHOICES`, `norm_meta`,
`norm_warps`, `rotary_meta`, `silu_block`), so the list follows the dispatch code. What the dispatch does
not choose — the model's dtype and KV cache dtype, heads per KV head, head dim, block size, int4 group
size, the decoder's widths — comes in as `VariantParams`.

`compile_variants` compiles them with Triton's real compiler for an NVIDIA target
(`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`: LLVM, then ptxas, which
Triton ships), in worker processes (the interpreter must be off, and a process's
TRITON_INTERPRET is read once, when triton is imported), and reads each cubin's resources with
cuobjdump: registers per thread, spills (local memory / 4 bytes, what Triton's `n_spills`
reports on a GPU), and Triton's shared memory. Pointer arguments get 16-byte divisibility, as
torch's allocations give the launcher; integer arguments are compiled as i32 without the
launcher's divisibility and ==1 specializations.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
               "float8_e4m3fn": torch.float8_e4m3fn}
_POINTER = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv",
            torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}
_FLOAT_ARGS = {"scale_log2", "k_scale", "v_scale", "eps"}


@dataclass
class VariantParams:
    """What the model and the engine flags decide (dtype names as in `DTYPE_NAMES`)."""

    dtype_pairs: list[tuple[str, str]]  # (model / query dtype, KV pool dtype)
    attention_shapes: list[tuple[int, int]]  # (query heads per KV head, head dim)
    block_sizes: list[int]  # tokens per KV block
    int4_x_dtypes: list[str]  # activation dtypes of int4 linears
    int4_group_sizes: list[int]  # input columns per group; -1: one group per row (per-channel)
    # (hidden size, intermediate size, query heads, KV heads, head dim) of the decoder ops, in each model dtype
    decoder_shapes: list[tuple[int, int, int, int, int]] = field(default_factory=list)


@dataclass
class Variant:
    kernel: str  # the @triton.jit function's name
    module: str  # the module that defines it
    signature: dict[str, str]  # argument -> Triton type ("*fp16", "i32", "fp32", "constexpr")
    constexprs: dict[str, Any]
    tags: dict[str, Any] = field(default_factory=dict)  # pointer dtypes and other labels for reports
    options: dict[str, Any] = field(default_factory=dict)  # compile options the launcher passes (num_warps)

    def label(self) -> str:
        items = {**self.tags, **self.constexprs}
        return self.kernel + "[" + ",".join(f"{k}={v}" for k, v in items.items()) + "]"

    def features(self, keys: set[str] | None = None) -> set[tuple[str, ...]]:
        """(kernel, name, value) items a covering subset must contain at least once: every tag and
        constexpr, or only those named in `keys` plus whether the launch splits (split-KV / split-K)."""
        items = {**self.tags, **self.constexprs}
        if keys is None:
            return {(self.kernel, k, str(v)) for k, v in items.items()}
        split = max(items.get("NUM_SPLITS", 1), items.get("SPLIT_K", 1)) > 1
        return {(self.kernel, k, str(v)) for k, v in items.items() if k in keys} | {(self.kernel, "split", str(split))}

    def supported_on(self, arch: int) -> bool:
        """Whether the launchers can launch it on compute capability `arch` (fp8 pools need FP8_MIN_ARCH)."""
        from llmopt.kernels.triton_write_kv import FP8_MIN_ARCH

        return arch >= FP8_MIN_ARCH or "float8_e4m3fn" not in self.tags.values()


# what changes the generated code most: dtypes, exact fp32 products, bias, act-order, one group, splitting
SMOKE_KEYS = {"q", "kv", "x", "FP32_DOT", "HAS_BIAS", "HAS_PERM", "ONE_GROUP", "HAS_RESIDUAL", "ONE_PASS"}


def _jit(module: str, kernel: str):
    return getattr(importlib.import_module(module), kernel)


def _variant(module: str, kernel: str, pointers: dict[str, torch.dtype], constexprs: dict[str, Any],
             tags: dict[str, Any] | None = None, options: dict[str, Any] | None = None) -> Variant:
    fn = _jit(module, kernel)
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTER[pointers[name]]
        else:
            signature[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    assert set(constexprs) <= set(fn.arg_names), (kernel, set(constexprs) - set(fn.arg_names))
    return Variant(kernel, module, signature, dict(constexprs), dict(tags or {}), dict(options or {}))


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def attention_variants(q_dtype: torch.dtype, kv_dtype: torch.dtype, group: int, head_dim: int,
                       block_size: int) -> list[Variant]:
    """write_kv, decode (every split count `choose_num_splits` can return), merge and prefill."""
    from llmopt.kernels import triton_paged_decode as decode
    from llmopt.kernels import triton_paged_prefill as prefill
    from llmopt.kernels.triton_write_kv import write_kv_meta

    tags = {"q": _short(q_dtype), "kv": _short(kv_dtype)}
    attn = dict(q_ptr=q_dtype, k_ptr=kv_dtype, v_ptr=kv_dtype, tables_ptr=torch.int32, out_ptr=q_dtype)
    out = [_variant("llmopt.kernels.triton_write_kv", "_write_kv_kernel",
                    dict(k_cache_ptr=kv_dtype, v_cache_ptr=kv_dtype, slots_ptr=torch.int64, k_ptr=q_dtype,
                         v_ptr=q_dtype),  # the runtime's slot_mapping is int64
                    write_kv_meta(head_dim), tags)]
    for splits in decode.SPLIT_CHOICES:
        out.append(_variant(decode.__name__, "_decode_split_kernel",
                            dict(attn, lens_ptr=torch.int32, part_out_ptr=torch.float32, part_lse_ptr=torch.float32),
                            decode.decode_meta(group, head_dim, block_size, splits, q_dtype), tags))
        if splits > 1:
            out.append(_variant(decode.__name__, "_merge_splits",
                                dict(part_out_ptr=torch.float32, part_lse_ptr=torch.float32, out_ptr=q_dtype),
                                decode.merge_meta(head_dim, splits), {"q": _short(q_dtype)}))
    out.append(_variant(prefill.__name__, "_prefill_kernel",
                        dict(attn, cu_q_ptr=torch.int32, ctx_ptr=torch.int32),
                        prefill.prefill_meta(group, head_dim, block_size, q_dtype), tags))
    return out


def _packed_stand_in(group_size: int, has_perm: bool, in_features: int = 4096):
    """A PackedInt4 with the layout only (what the launchers read: groups, group width, act-order): no weights."""
    from llmopt.kernels.triton_int4 import PackedInt4

    groups = 1 if group_size == -1 else in_features // group_size
    empty = torch.empty(groups, 1)
    return PackedInt4(empty, empty, empty, torch.empty(1) if has_perm else None, in_features, 1,
                      in_features if group_size == -1 else group_size)


def int4_variants(x_dtype: torch.dtype, group_size: int, has_perm: bool, has_bias: bool) -> list[Variant]:
    """gemv and split-K (every split `_split_k` can return), the unsplit GEMM, and the dequantizer."""
    from llmopt.kernels import triton_int4_kernels as k

    packed = _packed_stand_in(group_size, has_perm)
    tags = {"x": _short(x_dtype), "group": group_size}
    pointers = dict(x_ptr=x_dtype, qw_ptr=torch.int32, s_ptr=torch.float16, z_ptr=torch.uint8, perm_ptr=torch.int32,
                    bias_ptr=x_dtype, out_ptr=x_dtype, part_ptr=torch.float32, counter_ptr=torch.int32)
    out = []
    for split in k.SPLIT_K_CHOICES:
        out.append(_variant(k.__name__, "_gemv_kernel", pointers, k.gemv_meta(packed, has_bias, split), tags))
        out.append(_variant(k.__name__, "_gemm_kernel", pointers,
                            k.gemm_meta(packed, has_bias, split, "splitk", x_dtype), tags))
    out.append(_variant(k.__name__, "_gemm_kernel", pointers, k.gemm_meta(packed, has_bias, 1, "gemm", x_dtype), tags))
    if not has_bias:  # the dequantizer takes no bias
        out.append(_variant(k.__name__, "_dequant_kernel", dict(pointers, out_ptr=x_dtype),
                            k.dequant_meta(packed), tags))
    return out


def fp8_variants(x_dtype: torch.dtype, has_bias: bool) -> list[Variant]:
    """The FP8 matmul's kernels (`triton_fp8_kernels`): the weight-only upcast (any GPU: bytes, no fp8
    type) at both row tilings, and, where x is rounded to e4m3 (sm_89+), the row quantizer and the
    native e4m3 x e4m3 kernel."""
    from llmopt.kernels import triton_fp8_kernels as k

    out = []
    for block_m in sorted({k._block_m(1), k._block_m(1 << 20)}):  # the few-row and the many-row tiling
        out.append(_variant(k.__name__, "_upcast_kernel",
                            dict(x_ptr=x_dtype, w_ptr=torch.uint8, s_ptr=torch.float32, bias_ptr=torch.float32,
                                 out_ptr=x_dtype),
                            dict(HAS_BIAS=has_bias, INPUT_PRECISION="ieee" if x_dtype == torch.float32 else "tf32",
                                 BLOCK_M=block_m, BLOCK_N=k.BLOCK_N, BLOCK_K=k.UPCAST_BLOCK_K),
                            {"x": _short(x_dtype), "w": "e4m3 bytes"}))
        out.append(_variant(k.__name__, "_native_kernel",
                            dict(xq_ptr=torch.float8_e4m3fn, xs_ptr=torch.float32, w_ptr=torch.float8_e4m3fn,
                                 ws_ptr=torch.float32, bias_ptr=torch.float32, out_ptr=x_dtype),
                            dict(HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=k.BLOCK_N, BLOCK_K=k.NATIVE_BLOCK_K),
                            {"x": _short(x_dtype), "w": "float8_e4m3fn"}))
    out.append(_variant(k.__name__, "_quantize_rows_kernel",
                        dict(x_ptr=x_dtype, q_ptr=torch.float8_e4m3fn, s_ptr=torch.float32),
                        dict(FP8_MAX_=k.FP8_MAX, MIN_SCALE_=k.MIN_SCALE, BLOCK_K=k.QUANT_BLOCK_K),
                        {"x": _short(x_dtype), "w": "float8_e4m3fn"}))
    return out


def decoder_op_variants(dtype: torch.dtype, hidden: int, intermediate: int, q_heads: int, kv_heads: int,
                        head_dim: int) -> list[Variant]:
    """RMSNorm (alone and with the residual add), rotary and silu*up (`triton_decoder_ops`) for a model
    of `dtype` with these widths."""
    from llmopt.kernels import triton_decoder_ops as k

    tags = {"x": _short(dtype)}
    out = []
    for has_residual in (False, True):
        meta = k.norm_meta(hidden, has_residual)
        out.append(_variant(k.__name__, "_rms_norm_kernel",
                            dict(x_ptr=dtype, residual_ptr=dtype, weight_ptr=dtype, out_ptr=dtype,
                                 residual_out_ptr=dtype),
                            meta, tags, {"num_warps": k.norm_warps(meta["BLOCK"])}))
    out.append(_variant(k.__name__, "_rotary_kernel",
                        dict(q_ptr=dtype, k_ptr=dtype, cos_ptr=dtype, sin_ptr=dtype, q_out_ptr=dtype, k_out_ptr=dtype),
                        k.rotary_meta(head_dim, q_heads, kv_heads), tags))
    out.append(_variant(k.__name__, "_silu_and_mul_kernel", dict(gate_up_ptr=dtype, out_ptr=dtype),
                        dict(BLOCK=k.silu_block(intermediate)), tags))
    return out


def enumerate_variants(params: VariantParams) -> list[Variant]:
    """Every distinct variant for these parameters, in a fixed order (duplicates dropped)."""
    variants: list[Variant] = []
    for q, kv in params.dtype_pairs:
        for group, head_dim in params.attention_shapes:
            for block_size in params.block_sizes:
                variants += attention_variants(DTYPE_NAMES[q], DTYPE_NAMES[kv], group, head_dim, block_size)
    for x in params.int4_x_dtypes:
        for group_size in params.int4_group_sizes:
            for has_perm in (False, True):
                for has_bias in (False, True):
                    variants += int4_variants(DTYPE_NAMES[x], group_size, has_perm, has_bias)
        for has_bias in (False, True):
            variants += fp8_variants(DTYPE_NAMES[x], has_bias)
    for model_dtype in dict.fromkeys(q for q, _ in params.dtype_pairs):
        for shape in params.decoder_shapes:
            variants += decoder_op_variants(DTYPE_NAMES[model_dtype], *shape)
    seen, unique = set(), []
    for v in variants:
        key = (v.kernel, json.dumps(v.signature, sort_keys=True), json.dumps(v.constexprs, sort_keys=True),
               json.dumps(v.options, sort_keys=True))
        if key not in seen:
            seen.add(key)
            unique.append(v)
    return unique


def covering_subset(variants: list[Variant], keys: set[str] | None = None) -> list[Variant]:
    """Few variants in which every (kernel, argument, value) of the whole list appears at least once
    (`Variant.features(keys)`; greedy set cover: the variant adding most uncovered items first)."""
    uncovered = set().union(*(v.features(keys) for v in variants))
    chosen = []
    while uncovered:
        best = max(variants, key=lambda v: len(v.features(keys) & uncovered))
        chosen.append(best)
        uncovered -= best.features(keys)
    return sorted(chosen, key=variants.index)


def select(variants: list[Variant], scope: str) -> list[Variant]:
    """"smoke" (every dtype, flag and split-or-not per kernel, at the smallest head dim: ~25), "cover"
    (every value of every constexpr too: ~35) or "full" (all)."""
    if scope == "full":
        return list(variants)
    if scope not in ("smoke", "cover"):
        raise ValueError(f"unknown scope {scope!r}: smoke, cover or full")
    if scope == "cover":
        return covering_subset(variants)
    # the smallest head dims first: the same lowering of every dtype and flag, a fraction of the compile time
    by_size = sorted(variants, key=lambda v: v.constexprs.get("HEAD_DIM_PAD", 0))
    return sorted(covering_subset(by_size, SMOKE_KEYS), key=variants.index)


@dataclass
class CompileResult:
    label: str
    kernel: str
    arch: int  # compute capability, e.g. 90
    ok: bool
    error: str = ""
    registers: int = 0  # per thread
    spills: int = 0  # local memory per thread / 4 bytes (Triton's n_spills)
    shared_bytes: int = 0
    num_warps: int = 0
    seconds: float = 0.0


def _resources(cubin: bytes) -> dict[str, int]:
    """REG / LOCAL / ... of the cubin's one kernel, from cuobjdump (shipped with Triton)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {k: int(v) for k, v in (item.split(":", 1) for item in line.split() if ":" in item and "[" not in item)}


def _compile_one(variant: Variant, arch: int) -> CompileResult:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit(variant.module, variant.kernel)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if variant.signature.get(name, "").startswith("*")}
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn, variant.signature, variant.constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options=variant.options or None)
    except Exception as e:  # noqa: BLE001  (a compile error of any kind is the result)
        return CompileResult(variant.label(), variant.kernel, arch, False, error=f"{type(e).__name__}: {e}"[:2000],
                             seconds=time.perf_counter() - start)
    res = _resources(compiled.asm["cubin"])
    return CompileResult(variant.label(), variant.kernel, arch, True, registers=res["REG"], spills=res["LOCAL"] // 4,
                         shared_bytes=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                         seconds=time.perf_counter() - start)


def _worker() -> None:
    """Compile the tasks read from stdin ({"params": ..., "tasks": [[index, arch], ...]}); JSON lines out."""
    job = json.load(sys.stdin)
    variants = enumerate_variants(VariantParams(**job["params"]))
    for index, arch in job["tasks"]:
        print(json.dumps(asdict(_compile_one(variants[index], arch))), flush=True)


def compile_tasks(variants: list[Variant], chosen: list[Variant], archs: list[int]) -> list[tuple[int, int]]:
    """(index in `variants`, arch) for each chosen variant on each arch that can launch it."""
    return [(variants.index(v), arch) for v in chosen for arch in archs if v.supported_on(arch)]


def compile_variants(params: VariantParams, tasks: list[tuple[int, int]], jobs: int = 2) -> list[CompileResult]:
    """Compile (index of `enumerate_variants(params)`, arch) `tasks` in `jobs` processes (each with
    the interpreter off); results in task order."""
    chunks = [tasks[j::jobs] for j in range(jobs) if tasks[j::jobs]]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    code = "from llmopt.kernels.triton_variants import _worker; _worker()"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in chunks]
    for proc, chunk in zip(procs, chunks):
        proc.stdin.write(json.dumps({"params": asdict(params), "tasks": chunk}))
        proc.stdin.close()
    results: dict[tuple[int, int], CompileResult] = {}
    for proc, chunk in zip(procs, chunks):
        lines = proc.stdout.read().splitlines()
        stderr = proc.stderr.read()
        if proc.wait() != 0 or len(lines) != len(chunk):
            raise RuntimeError(f"compile worker failed (exit {proc.returncode}):\n{stderr[-4000:]}")
        for task, line in zip(chunk, lines):
            results[tuple(task)] = CompileResult(**json.loads(line))
    return [results[tuple(t)] for t in tasks]
