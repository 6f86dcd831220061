#!/usr/bin/env python
"""Does a quantized GGUF answer like the F16 one? Greedy tokens through llama.cpp, side by side.

Exports the default model (or --model) as F16 and as each --types entry with llmopt,
and optionally the same types made by llama.cpp's own quantizer from that F16 file
(--llama-cpp-too), then runs 14 short prompts (10 chat questions, 4 plain-text openings)
greedily through llama-cpp-python, argmax straight from its logits. For each prompt it
reports whether the first --tokens tokens are equal and, where they part, the F16 file's
top-2 logit gap at that position (a small gap = a near tie that any rounding can flip).

    python scripts/gguf_greedy_agreement.py --types Q8_0 --llama-cpp-too
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import closing
from pathlib import Path

import numpy as np

from llmopt.core import resolve
from llmopt.core.tokenizer import Tokenizer
from llmopt.core.weights import load_safetensors, safetensors_files
from llmopt.quant.gguf_export import GGUF_TYPES, _llama_cpp_quantize, write_gguf

CHATS = ["Name the three primary colors.", "What is 2 + 2?", "Write a haiku about the sea.",
         "What is the capital of France?", "Who wrote Romeo and Juliet?", "What color is the sky?",
         "Translate 'hello' into Spanish.", "What is the boiling point of water?", "Give me a synonym for happy.",
         "How many days are in a week?"]
TEXTS = ["The capital of France is", "Once upon a time", "def add(a, b):", "The largest planet in the solar system is"]


def greedy(llama_cpp, path: Path, prompt: list[int], eos: int, max_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    tokens, scores = [], []
    with closing(llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)) as llm:
        llm.eval(prompt)
        while len(tokens) < max_tokens:
            row = np.array(llm.scores[llm.n_tokens - 1])
            token = int(np.argmax(row))
            if token == eos:
                break
            tokens.append(token)
            scores.append(row)
            llm.eval([token])
    return tokens, scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--types", default="Q8_0", help="comma-separated GGUF types to compare with F16")
    ap.add_argument("--llama-cpp-too", action="store_true", help="also compare llama.cpp's own quantization of the F16")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    types = args.types.split(",")
    unknown = [t for t in types if t not in GGUF_TYPES or t == "F16"]
    if unknown:
        ap.error(f"unknown or F16 --types {','.join(unknown)}; choose from {', '.join(t for t in GGUF_TYPES if t != 'F16')}")
    if args.llama_cpp_too and any(t in ("F32", "BF16") for t in types):
        ap.error("--llama-cpp-too quantizes with llama.cpp: give quantized types (Q8_0, Q4_K_M, ...)")
    if args.tokens < 1:
        ap.error("--tokens must be positive")
    import llama_cpp

    folder = resolve(args.model).path
    config = json.loads((Path(folder) / "config.json").read_text())
    tensors, tokenizer = load_safetensors(safetensors_files(folder)), Tokenizer.from_dir(folder)
    eos = tokenizer.token_to_id(tokenizer.eos_token)
    with tempfile.TemporaryDirectory(prefix="gguf-agree-") as tmp:
        f16 = write_gguf(Path(tmp) / "F16.gguf", config, tensors, tokenizer, "F16")
        files = {}
        for gguf_type in types:
            files[f"llmopt {gguf_type}"] = write_gguf(Path(tmp) / f"{gguf_type}.gguf", config, tensors, tokenizer, gguf_type)
            if args.llama_cpp_too:
                made = Path(tmp) / f"{gguf_type}-llama.cpp.gguf"
                _llama_cpp_quantize(f16, made, gguf_type)
                files[f"llama.cpp {gguf_type}"] = made
        prompts = [(q, tokenizer.encode_chat([{"role": "user", "content": q}])) for q in CHATS]
        prompts += [(t, tokenizer.encode(t)) for t in TEXTS]
        reference = {text: greedy(llama_cpp, f16, ids, eos, args.tokens) for text, ids in prompts}
        for name, path in files.items():
            agree = 0
            print(f"\n{name} vs F16, {args.tokens} greedy tokens:")
            for text, ids in prompts:
                ref_tokens, ref_scores = reference[text]
                got, _ = greedy(llama_cpp, path, ids, eos, args.tokens)
                part = next((i for i, (a, b) in enumerate(zip(ref_tokens, got)) if a != b),
                            None if len(ref_tokens) == len(got) else min(len(ref_tokens), len(got)))
                if part is None:
                    agree += 1
                    print(f"  same            {text!r}")
                else:
                    gap = ""
                    if part < len(ref_scores):
                        top2 = np.sort(ref_scores[part])[-2:]
                        gap = f", F16 top-2 gap {top2[1] - top2[0]:.3f}"
                    print(f"  parts at {part:2d}{gap:24} {text!r}")
            print(f"  {agree}/{len(prompts)} prompts identical")


if __name__ == "__main__":
    main()
