"""One engine's 512-token prompt pass (a 1-token generation) with one feature of the CPU prompt path switched
on and off in turn, in one process, so the VM's swings hit both alike. Prints the median and best pass per setting.

    python scripts/bench_prompt_pass.py default --switch attention   # prompt attention's bf16 products vs fp32 ones
    python scripts/bench_prompt_pass.py default --switch handover    # o/down bf16 products handed over vs widened
    python scripts/bench_prompt_pass.py default --switch attention --profile 5   # then cProfile 5 passes, both on

`attention`: the C++ prompt attention kernel's bf16 products (`cpu_prefill_attention.kernel_math`) against its fp32
products; `handover`: o_proj's and down_proj's bf16 prompt products handed to their consumers as they are
(`DenseLinear.prefill_bf16_result`) against widened to fp32 first.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from llmopt.core.memory import reuse_freed_memory
from llmopt.core.source import resolve
from llmopt.kernels import cpu_prefill_attention
from llmopt.loader import load
from llmopt.model.linear import DenseLinear
from llmopt.runtime import SamplingParams
from llmopt.runtime.config import EngineConfig
from llmopt.runtime.engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model spec (default, a folder, a shipped config)")
    parser.add_argument("--switch", choices=["attention", "handover"], required=True)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--passes", type=int, default=4, help="timed passes per setting per round")
    parser.add_argument("--profile", type=int, default=0, help="then this many passes under cProfile (the switch on): "
                        "where a pass goes, by self time")
    args = parser.parse_args()
    reuse_freed_memory()
    loaded = load(resolve(args.model))
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=1, enable_prefix_caching=False,
                                            max_num_batched_tokens=max(1024, args.prompt_len)))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    kernel_math = cpu_prefill_attention.kernel_math
    layers = loaded.model.model.layers
    handed = [m for layer in layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj) if isinstance(m, DenseLinear)]
    handed_at_load = [m.prefill_bf16_result for m in handed]
    if args.switch == "handover" and not any(handed_at_load):
        parser.error("this model's o/down products are not handed over in bf16 on this CPU: nothing to switch")

    def use(on: bool) -> None:
        if args.switch == "attention":
            cpu_prefill_attention.kernel_math = kernel_math if on else (lambda q, dtype, n: kernel_math(q, None, n))
        else:
            for m, at_load in zip(handed, handed_at_load):
                m.prefill_bf16_result = at_load and on

    count = iter(range(1 << 62))

    def one_pass() -> float:
        prompt = [(7 * j + next(count)) % 40000 + 100 for j in range(args.prompt_len)]
        start = time.perf_counter()
        engine.add_request(prompt, params, request_id=f"pass-{next(count)}")
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for _ in range(args.rounds):
            for setting in ("off", "on"):
                use(setting == "on")
                one_pass()  # warm-up of this setting
                times[setting] += [one_pass() for _ in range(args.passes)]
    finally:
        use(True)
    for setting, ts in times.items():
        print(f"{args.switch} {setting}: median {statistics.median(ts) * 1e3:.1f} ms a pass, best "
              f"{args.prompt_len / min(ts):.0f} tok/s ({len(ts)} passes)")
    if args.profile > 0:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.profile):
            one_pass()
        profiler.disable()
        print(f"cProfile over {args.profile} passes:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
