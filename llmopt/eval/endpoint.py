"""An OpenAI-compatible endpoint as a log-likelihood source (`llmopt eval --base-url URL`).

A served deployment (`llmopt serve`, vLLM, a llama.cpp server...) is scored through
`/v1/completions` with `echo: true` and `logprobs`: every prompt position comes back with
log p(token | the tokens before it) and the top-k alternatives. Prompts are sent as token
ids, tokenized here by the model's own tokenizer, so the endpoint scores exactly the tokens
a local baseline scores; `max_tokens` is 1 (lm-eval's `local-completions` sends the same:
vLLM refuses 0 and llama-cpp-python reads 0 as "up to the context's end"), and the one
generated token is ignored.

The numbers then go through the same code as an in-process model's: llama.cpp's windowing
(`windows.py`) and per-token NLL for perplexity, `kld.topk_position_stats` + `kld.summarize`
for KL divergence, lm-eval's pair encoding (`loglikelihood.encode_pairs`) and `mmlu.py` for
MMLU.

KLD from an endpoint is an approximation: the endpoint gives only its top-k log-probs per
position (`--top-logprobs`, 20 by default, vLLM's default cap). KLD is computed over those
tokens plus the observed one, with all the remaining probability of each side in one "tail"
bucket; that coarsened KLD is a lower bound of the full-vocabulary KLD (log-sum inequality).
How loose depends on how much mass lies outside the top k: on the tiny random test model (flat
rows over 263 tokens) top-20 gives 0.10 nats where the full KLD is 0.64; peaked real models
lose far less. Alternatives are named by their text; a text several ids share (byte-fallback
pieces such as '\ufffd') cannot be placed and its mass stays in the tail. Δp is exact, and
same-top is exact whenever the candidate's top token is named unambiguously.

Before any scoring, `check` probes that the endpoint's prompt log-probabilities are real:
one per prompt token, finite, and aligned (the echoed log-prob of a prompt's last token
equals that token's log-prob when the endpoint generates it greedily after the rest of the
prompt). Known failures it names: llama.cpp's C++ server returns the generated tokens'
log-probs only; llama-cpp-python's server (`--logits_all true`) shifts them by one position
(position i holds the log-prob of token i under the distribution predicting token i+1) and
takes text prompts only.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import torch

from llmopt.errors import LlmoptError
from llmopt.eval.metrics.kld import kld_logprobs, summarize, topk_position_stats
from llmopt.eval.metrics.loglikelihood import encode_pairs
from llmopt.eval.metrics.textscore import CHUNK_ROWS, TextScores
from llmopt.eval.metrics.windows import chunk_prompt, plan_chunks
from llmopt.openai_http import auth_headers, probe

log = logging.getLogger("llmopt.eval")

DEFAULT_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs; llmopt serve's cap
DEFAULT_NUM_CONCURRENT = 4
# Plain ASCII, so every server renders its tokens the same way as our tokenizer decodes them.
PROBE_TEXT = ("The library opens at nine in the morning and closes at six in the evening. On Sundays it is "
              "closed, so the students study in the park across the")
# Prefill and decode run different kernels (and a quantized server rounds activations on
# one path only): a few hundredths of a nat apart is agreement; a shifted position is not.
ALIGN_TOLERANCE = 0.05
PROBE_ALTERNATIVES = 5  # top alternatives the probe asks for (OpenAI's own cap): where a shifted server shows it


@dataclass
class EndpointConfig:
    url: str  # base URL, without /v1
    api_key: str | None = None
    served_model_name: str | None = None  # default: the first id /v1/models lists
    top_logprobs: int = DEFAULT_TOP_LOGPROBS  # alternatives per position, for KLD
    num_concurrent: int = DEFAULT_NUM_CONCURRENT  # requests in flight
    timeout: float = 600.0  # seconds per request


@dataclass
class PromptScores:
    logprobs: list[float]  # log p(token i | tokens < i) for prompt positions i = 1 .. n-1
    top: list[dict[int, float]] | None = None  # per position 1 .. n-1: token id -> log-prob, when asked


class _Refused(Exception):
    """The endpoint answered a request with an HTTP error."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Endpoint:
    """A served model, scored over HTTP with token-id prompts tokenized by `tokenizer`."""

    def __init__(self, config: EndpointConfig, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.url = config.url
        self.model = probe(config.url, config.api_key, config.served_model_name)
        self._client = httpx.Client(headers=auth_headers(config.api_key), timeout=config.timeout)
        self._ids_by_text: dict[str, int | None] | None = None

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "served_model": self.model, "top_logprobs": self.config.top_logprobs}

    # ------------------------------------------------------------------ HTTP

    def _complete(self, prompt: list[int] | str, *, echo: bool, logprobs: int) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "echo": echo,
                "logprobs": logprobs}
        where = f"{self.url}/v1/completions"
        try:
            response = self._client.post(where, json=body)
        except httpx.HTTPError as exc:
            raise LlmoptError(f"{where}: {type(exc).__name__}: {exc or 'no answer'}") from None
        if response.status_code != 200:  # llama-cpp-python answers a request it cannot parse with 500
            raise _Refused(response.status_code, _error_message(response))
        try:
            choice = response.json()["choices"][0]
            return {"text": choice.get("text", ""), "logprobs": choice.get("logprobs") or {}}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise LlmoptError(f"{where} answered with no completion choice: {response.text[:200]!r}") from None

    def _score_one(self, ids: list[int], top: int) -> PromptScores:
        try:
            out = self._complete(ids, echo=True, logprobs=max(top, 1))
        except _Refused as exc:
            raise LlmoptError(f"{self.url}/v1/completions refused a {len(ids)}-token prompt (HTTP {exc.status}): "
                              f"{exc.message}") from None
        lp = out["logprobs"]
        values = list(lp.get("token_logprobs") or [])
        if len(values) < len(ids) or not all(_finite(v) for v in values[1:len(ids)]):
            raise LlmoptError(f"{self.url} returned {len(values)} prompt log-probabilities for a {len(ids)}-token "
                              "prompt, or non-finite ones, after its probe passed")
        scores = PromptScores([float(v) for v in values[1:len(ids)]])
        if top:
            tops = list(lp.get("top_logprobs") or [])[1:len(ids)]
            scores.top = [self._top_ids(t) for t in tops]
        return scores

    def score(self, prompts: Sequence[list[int]], top: int = 0) -> list[PromptScores]:
        """Prompt log-probabilities of each token-id prompt (with up to `top` alternatives per position)."""
        done, start = [0], time.perf_counter()

        def one(ids: list[int]) -> PromptScores:
            result = self._score_one(ids, top)
            done[0] += 1
            if done[0] % 100 == 0:
                log.info("endpoint: %d/%d prompts scored (%.0f s)", done[0], len(prompts), time.perf_counter() - start)
            return result

        with ThreadPoolExecutor(max(1, self.config.num_concurrent)) as pool:
            return list(pool.map(one, prompts))

    # ------------------------------------------------------------------ tokens

    def _token_id(self, text: str) -> int | None:
        """The id of a token the server names by its text (or vLLM's "token_id:N"); None if ambiguous."""
        if text.startswith("token_id:") and text[9:].isdigit():
            return int(text[9:])
        if self._ids_by_text is None:
            table: dict[str, int | None] = {}
            for i in range(self.tokenizer.vocab_size):
                piece = self.tokenizer.decode([i], skip_special_tokens=False)
                table[piece] = None if piece in table else i  # two ids, one text: cannot tell which
            self._ids_by_text = table
        return self._ids_by_text.get(text)

    def _top_ids(self, top: dict[str, float] | None) -> dict[int, float]:
        out: dict[int, float] = {}
        for text, value in (top or {}).items():
            token = self._token_id(text)
            if token is not None and _finite(value):  # an ambiguous text's mass stays in the tail bucket
                out[token] = float(value)
        return out

    # ------------------------------------------------------------------ the probe

    def check(self, top: int = 0) -> None:
        """Refuse (LlmoptError naming the problem) an endpoint whose prompt log-probs cannot be trusted."""
        ids = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        try:
            first = self._complete(ids, echo=False, logprobs=PROBE_ALTERNATIVES)
        except _Refused as exc:
            raise LlmoptError(self._diagnose_text_only(exc)) from None
        generated = _generated(first)
        if generated is None:
            raise LlmoptError(f"{self.url} returns no log-probability for a generated token (logprobs ignored): "
                              "llmopt eval needs echo + logprobs on /v1/completions")
        # the generated token, else its most likely alternative whose text names one token of ours
        # (a byte-fallback piece such as '\ufffd' names several)
        choices = [generated, *sorted(_alternatives(first), key=lambda kv: -kv[1])]
        known = [(text, value, self._token_id(text)) for text, value in choices]
        known = [k for k in known if k[2] is not None]
        if not known:
            raise LlmoptError(f"{self.url} generated the token {generated[0]!r}, which MODEL's tokenizer does not have: "
                              "pass the model the endpoint serves as MODEL (for its tokenizer)")
        g_text, g_logprob, g_id = known[0]
        prompt = [*ids, g_id]
        try:
            scored = self._complete(prompt, echo=True, logprobs=max(top, PROBE_ALTERNATIVES))
        except _Refused as exc:
            raise LlmoptError(f"{self.url} refuses echo + logprobs={max(top, PROBE_ALTERNATIVES)} on /v1/completions "
                              f"(HTTP {exc.status}: {exc.message})"
                              + ("; try a smaller --top-logprobs" if "logprob" in exc.message.lower() else "")) from None
        lp = scored["logprobs"]
        values = list(lp.get("token_logprobs") or [])
        problem = _alignment_problem(values, list(lp.get("top_logprobs") or []), len(prompt), g_text, g_logprob)
        if problem:
            raise LlmoptError(f"{self.url} cannot be evaluated: its prompt log-probabilities {problem}")
        tokens = list(lp.get("tokens") or [])[:len(prompt)]
        ours = [self.tokenizer.decode([i], skip_special_tokens=False) for i in prompt]
        if tokens and sum(a != b for a, b in zip(tokens, ours)) > len(prompt) // 4:
            raise LlmoptError(f"{self.url} echoes tokens {tokens[:6]} where MODEL's tokenizer has {ours[:6]}: the "
                              "endpoint serves another vocabulary; pass the model it serves as MODEL")
        if top:
            tops = list(lp.get("top_logprobs") or [])[1:len(prompt)]
            sizes = [len(self._top_ids(t)) for t in tops]
            if len(tops) < len(prompt) - 1 or min(sizes, default=0) < 1:
                raise LlmoptError(f"{self.url} returns no top log-probabilities for prompt positions, which KLD needs: "
                                  "leave kld out of --tasks")
            if max(sizes) < top:  # a server's cap, or texts several ids share (they stay in the tail)
                log.warning("%s gives %d placeable alternatives per prompt position, fewer than --top-logprobs %d",
                            self.url, max(sizes), top)
        log.info("endpoint %s (%s): prompt log-probabilities aligned (last token %.4f echoed vs %.4f generated)",
                 self.url, self.model, values[len(prompt) - 1], g_logprob)

    def _diagnose_text_only(self, refused: _Refused) -> str:
        """Token-id prompts were refused: say so, and what else a text prompt shows (llama-cpp-python: the shift)."""
        why = (f"{self.url} refuses token-id prompts (HTTP {refused.status}: {refused.message}); llmopt eval sends "
               "token ids so that the endpoint scores exactly the tokens the baseline scores")
        try:
            first = self._complete(PROBE_TEXT, echo=False, logprobs=1)
            generated = _generated(first)
            if generated is None:
                return why
            g_text, g_logprob = generated
            scored = self._complete(PROBE_TEXT + first["text"], echo=True, logprobs=PROBE_ALTERNATIVES)
        except (_Refused, LlmoptError):
            return why
        lp = scored["logprobs"]
        values, tokens = list(lp.get("token_logprobs") or []), list(lp.get("tokens") or [])
        # the prompt's tokens as the server split them: the echoed pieces that spell the prompt (llama-cpp-python
        # leaves the generated token out of an echoed list, others append it)
        prompt, text, n = PROBE_TEXT + first["text"], "", 0
        while n < len(tokens) and len(text) < len(prompt):
            text += str(tokens[n])
            n += 1
        if text != prompt or tokens[n - 1] != g_text:
            if len(values) <= 1:  # the generated token's entry alone: echo is ignored
                return why + "; with a text prompt, its prompt log-probabilities " + _alignment_problem(
                    values, [], 2, g_text, g_logprob)
            return why  # the text re-tokenized differently: nothing to compare
        problem = _alignment_problem(values[:n], list(lp.get("top_logprobs") or [])[:n], n, g_text, g_logprob)
        return why + (f"; with a text prompt, its prompt log-probabilities {problem}" if problem else "")


def _alignment_problem(values: list, tops: list, n: int, generated: str, generated_logprob: float) -> str | None:
    """What is wrong with the echoed log-probs `values` (and top alternatives `tops`) of an n-token prompt
    (then at most one generated token) whose last token, `generated`, the endpoint generated with
    `generated_logprob` after the rest of the prompt; None when nothing is."""
    if len(values) < n:
        return (f"are missing: {len(values)} log-probabilities came back for a {n}-token prompt with echo, those of the "
                "generated token only (llama.cpp's C++ server does this; lm-eval's log-likelihood tasks then score "
                "at chance)")
    if len(values) > n + 1:
        return f"do not come one per prompt token: {len(values)} entries for {n} prompt tokens and 1 generated"
    bad = [i for i in range(1, n) if not _finite(values[i])]
    if bad:
        return f"are not all finite numbers (position {bad[0]} of {n}: {values[bad[0]]!r})"
    last = float(values[n - 1])
    if abs(last - generated_logprob) <= ALIGN_TOLERANCE:
        return None
    # The distribution that predicted the last token, one position early: the last token's generated log-prob
    # sits in the alternatives of the position before it.
    early = tops[n - 2] if len(tops) >= n - 1 and isinstance(tops[n - 2], dict) else {}
    if generated in early and abs(float(early[generated]) - generated_logprob) <= ALIGN_TOLERANCE:
        return (f"are shifted by one position: position i holds the log-probability of token i under the distribution "
                f"that predicts token i+1 (the echoed last token has {last:.4f}; generated after the rest of the "
                f"prompt it has {generated_logprob:.4f}, which the endpoint reports one position early; "
                "llama-cpp-python's server does this)")
    return (f"are misaligned: the echoed log-probability of the prompt's last token is {last:.4f}, but the endpoint "
            f"gives that token {generated_logprob:.4f} when it generates it after the rest of the prompt")


def _generated(out: dict[str, Any]) -> tuple[str, float] | None:
    """(token text, log-prob) of the one generated token, or None without logprobs."""
    lp = out["logprobs"]
    tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    if not tokens or not values or not _finite(values[-1]):
        return None
    return str(tokens[-1]), float(values[-1])


def _alternatives(out: dict[str, Any]) -> list[tuple[str, float]]:
    """The generated position's top alternatives, (token text, log-prob)."""
    tops = out["logprobs"].get("top_logprobs") or [None]
    return [(str(k), float(v)) for k, v in (tops[-1] or {}).items() if _finite(v)]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message") or error.get("detail") if isinstance(error, dict) else error
        text = " ".join(str(message).split())
    except ValueError:
        text = " ".join(response.text.split()) or response.reason_phrase
    return text if len(text) <= 160 else text[:157] + "..."


# ---------------------------------------------------------------------------- the tasks


def score_text_endpoint(endpoint: Endpoint, ids: torch.Tensor, ctx_size: int, *, bos_id: int | None = None,
                        base: TextScores | None = None) -> TextScores:
    """`textscore.score_text` through an endpoint: per-token NLL of whole chunks of `ids`, and with `base`
    (a local baseline's TextScores with its store) the KLD from the endpoint's top-k log-probs."""
    chunks = plan_chunks(len(ids), ctx_size)
    if base is not None and (base.store is None or base.num_tokens != chunks.num_scored):
        raise LlmoptError("the baseline's stored scores do not match this text and --ctx-size; rerun with --no-cache")
    top = endpoint.config.top_logprobs if base is not None else 0
    prompts = [chunk_prompt(ids, chunks, c, bos_id) for c in range(chunks.count)]
    scores = endpoint.score(prompts, top)
    first, n = chunks.first, chunks.ctx_size
    # logprobs[i - 1] scores position i: the scored targets are positions first + 1 .. n - 1
    nll = np.concatenate([-np.asarray(s.logprobs[first:n - 1], dtype=np.float64) for s in scores])
    result = TextScores(nll=nll)
    if base is None:
        return result
    targets = torch.cat([ids[c * n + first + 1:(c + 1) * n] for c in range(chunks.count)])
    known = [s.top[j] for s in scores for j in range(first, n - 1)]
    width = 1 + max(len(k) for k in known)
    cand_ids = torch.full((len(known), width), -1, dtype=torch.long)
    cand_lp = torch.full((len(known), width), -math.inf, dtype=torch.float64)
    for row, (alternatives, target) in enumerate(zip(known, targets.tolist())):
        entries = {**alternatives, target: -float(nll[row])}  # the observed token is always known
        cand_ids[row, :len(entries)] = torch.tensor(list(entries))
        cand_lp[row, :len(entries)] = torch.tensor(list(entries.values()), dtype=torch.float64)
    head = torch.from_numpy(np.array(base.store.lm_head))
    klds, sames, deltas = [], [], []
    for s in range(0, len(known), CHUNK_ROWS):
        rows = slice(s, s + CHUNK_ROWS)
        base_rows = kld_logprobs(torch.from_numpy(np.array(base.store.hidden[rows])), head)
        kld, same, delta = topk_position_stats(base_rows, cand_ids[rows], cand_lp[rows],
                                               torch.from_numpy(np.array(base.nll[rows], dtype=np.float64)),
                                               torch.from_numpy(nll[rows]))
        klds.append(kld), sames.append(same), deltas.append(delta)
    result.kld = summarize(torch.cat(klds).numpy(), torch.cat(sames).numpy(), torch.cat(deltas).numpy(),
                           np.asarray(base.nll, np.float64), nll)
    return result


def endpoint_loglikelihoods(endpoint: Endpoint, pairs: Sequence[tuple[str, str]], max_length: int,
                            bos_id: int | None = None) -> list[float]:
    """log P(continuation | context) per pair, encoded as lm-eval encodes them, scored by the endpoint.
    Prompts longer than the context (less the one generated token) are cut from the left."""
    encoded = encode_pairs(endpoint.tokenizer, pairs, bos_id)
    room = max_length - 1
    prompts = [(ctx + cont)[-room:] for ctx, cont in encoded]
    for (ctx, cont), prompt in zip(encoded, prompts):
        if len(cont) >= len(prompt):
            raise LlmoptError(f"a continuation of {len(cont)} tokens leaves no context within {max_length} tokens")
    unique = list(dict.fromkeys(tuple(p) for p in prompts))
    scored = dict(zip(unique, endpoint.score([list(p) for p in unique])))
    return [float(sum(scored[tuple(p)].logprobs[-len(cont):])) for (_, cont), p in zip(encoded, prompts)]
