"""`BenchServeArgs`: `llmopt bench serve`'s options, declared once (the command's flags and a
recipe's `bench.serve` plan), and the one place they become a `ServeBenchConfig`."""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass
from typing import Optional

from llmopt.bench.datasets import WorkloadArgs
from llmopt.errors import LlmoptError
from llmopt.options import group, option

TARGET = "Server"


@dataclass
class BenchServeArgs:
    """The options of `llmopt bench serve`."""

    url: Optional[str] = option(None, "A running OpenAI-compatible server, e.g. http://127.0.0.1:8000 (llmopt, vLLM, "
                                "SGLang, llama.cpp, TGI).", panel=TARGET)
    model: Optional[str] = option(None, "Launch a server for this spec on a free local port instead (see --launch), "
                                  "and stop it afterwards.", "--model", panel=TARGET, recipe=None)
    launch: str = option("llmopt", "With --model: llmopt (`llmopt serve SPEC`), llama-server (llama.cpp's C++ "
                         "server built by scripts/build_llama_cpp.sh, with -np = the highest concurrency and "
                         "continuous batching) or llama-cpp (llama-cpp-python's server), the last two on a .gguf "
                         "file ('default' = the embedded one).", panel=TARGET,
                         choices=("llmopt", "llama-server", "llama-cpp"))
    serve_args: str = option("", "Extra flags for the launched server, one string, e.g. '--max-num-seqs 64 "
                             "--kv-cache-memory 1GiB'.", panel=TARGET)
    served_model_name: Optional[str] = option(None, "Model name to send (default: the first one /v1/models lists).",
                                              panel=TARGET)
    api_key: Optional[str] = option(None, "Bearer key (default: $OPENAI_API_KEY, $LLMOPT_API_KEY).", panel=TARGET,
                                    recipe=None)
    endpoint: str = option("chat", "chat (/v1/chat/completions, messages) or completions (/v1/completions, prompt "
                           "text).", choices=("chat", "completions"))
    workload: WorkloadArgs = group(WorkloadArgs, num_prompts=64, range_ratio=0.0)
    tokenizer: Optional[str] = option(None, "Model spec whose tokenizer builds the workload and counts tokens when the "
                                      "server sends no usage (default: --model, else 'default').")
    request_rate: float = option(math.inf, "Requests/s, arrivals Poisson (or gamma, see --burstiness); inf: all at "
                                 "once.", gt=0)
    burstiness: float = option(1.0, "Gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 steadier.", gt=0)
    max_concurrency: Optional[int] = option(None, "Most requests in flight at once.", ge=1)
    sweep: Optional[str] = option(None, "A curve: concurrency=1,4,16,64 or rate=1,2,4,inf.")
    num_warmups: int = option(1, "Unmeasured requests first (one-off costs).", ge=0)
    temperature: float = option(0.0, "Sampling temperature of every request (0 = greedy).", ge=0)
    ignore_eos: bool = option(True, "Ask for exactly max_tokens (a vLLM extra; servers without it stop at EOS, "
                              "counted as short outputs).")
    percentiles: list[float] = option(help="Latency percentiles to report.", comma=True,
                                      default_factory=lambda: [50.0, 90.0, 99.0])
    goodput: list[str] = option(help="SLOs in ms, vLLM's syntax: --goodput ttft:500 tpot:50 (also e2el).",
                                names=("--goodput",), default_factory=list)
    cost_per_hour: Optional[float] = option(None, "$ per hour of the server: adds $ per million output tokens.", ge=0)
    timeout: float = option(600.0, "Seconds without a byte from the server (connecting, queued, or between chunks) "
                            "before a request counts as failed.", gt=0)
    server_timeout: float = option(600.0, "Seconds for a launched server to answer.", gt=0)
    save_detailed: bool = option(False, "Per-request lists in results.json.", "--save-detailed")

    def config(self):
        """The run's ServeBenchConfig; LlmoptError (exit 2) for a bad value."""
        from llmopt.bench.online import ServeBenchConfig, check_config
        from llmopt.bench.online_metrics import parse_goodput, parse_percentiles

        try:
            serve_args = shlex.split(self.serve_args)
        except ValueError as exc:
            raise LlmoptError(f"--serve-args: {exc}") from None
        w = self.workload
        config = ServeBenchConfig(
            url=self.url, model=self.model, launch=self.launch, serve_args=serve_args,
            served_model_name=self.served_model_name,
            api_key=self.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("LLMOPT_API_KEY") or None,
            endpoint=self.endpoint, dataset=w.dataset, num_prompts=w.num_prompts, input_len=w.input_len,
            output_len=w.output_len or None, range_ratio=w.range_ratio, prefix_len=w.prefix_len,
            tokenizer=self.tokenizer, seed=w.seed, request_rate=self.request_rate, burstiness=self.burstiness,
            max_concurrency=self.max_concurrency, sweep=self.sweep, num_warmups=self.num_warmups,
            temperature=self.temperature, ignore_eos=self.ignore_eos,
            percentiles=parse_percentiles(",".join(map(str, self.percentiles))), goodput=parse_goodput(self.goodput),
            cost_per_hour=self.cost_per_hour, timeout=self.timeout, server_timeout=self.server_timeout)
        check_config(config)
        return config
