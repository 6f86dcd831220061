"""How far a float32 model's CPU prompt math under `--fp32-matmul-precision auto` (bf16 products where the CPU has
them) is from ieee: KLD, perplexity and top-token agreement over llama.cpp-style windows of a text (the bundled
one by default), in one process. `--attention-fp32` keeps prompt attention in fp32 products too.

    python scripts/prompt_math_fidelity.py default
    python scripts/prompt_math_fidelity.py default --attention-fp32
"""

from __future__ import annotations

import argparse

import torch

from llmopt.core.source import resolve
from llmopt.eval.metrics.text import bos_id, load_text
from llmopt.eval.metrics.windows import chunk_hidden, plan_chunks
from llmopt.loader import load
from llmopt.model.llama import Attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model spec of a float32 model")
    parser.add_argument("--ctx-size", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--attention-fp32", action="store_true", help="prompt attention in fp32 products under auto")
    args = parser.parse_args()
    loaded = load(resolve(args.model))
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = torch.tensor(tokenizer.encode(load_text(None).text, add_special_tokens=False))
    chunks = plan_chunks(len(ids), args.ctx_size, args.chunks)
    bos = bos_id(tokenizer)

    def log_probs(precision: str) -> tuple[torch.Tensor, torch.Tensor]:
        model.use_fp32_matmul_precision(precision)
        if args.attention_fp32:
            for m in model.modules():
                if isinstance(m, Attention):
                    m.prompt_math_dtype = None
        out, targets = [], []
        for t, hidden in chunk_hidden(model, ids, chunks, bos):
            out.append(torch.log_softmax(model.compute_logits(hidden).double(), -1))
            targets.append(t)
        return torch.cat(out), torch.cat(targets)

    ref, targets = log_probs("ieee")
    got, _ = log_probs("auto")
    kld = (ref.exp() * (ref - got)).sum(-1)
    ppl = lambda lp: torch.exp(-lp.gather(1, targets[:, None]).mean()).item()  # noqa: E731
    print(f"{chunks.num_scored} scored tokens: KLD mean {kld.mean():.2e}, p99 {kld.quantile(0.99):.2e}, max {kld.max():.2e}; "
          f"ppl {ppl(got):.4f} (ieee {ppl(ref):.4f}); same top token {(got.argmax(-1) == ref.argmax(-1)).double().mean() * 100:.2f}%")


if __name__ == "__main__":
    main()
