"""lm-evaluation-harness through `LlmoptLM`: local task YAMLs, offline, on a tiny random model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is an optional extra (pip install 'llmopt[lm-eval]')")

from lm_eval.tasks import TaskManager  # noqa: E402

from llmopt.loader import load  # noqa: E402
from llmopt.eval.metrics.lm_eval_adapter import LlmoptLM  # noqa: E402
from llmopt.eval.metrics.loglikelihood import loglikelihoods  # noqa: E402
from llmopt.eval.metrics.mmlu import evaluate_mmlu, load_mmlu, write_lm_eval_task  # noqa: E402

GEN_YAML = """\
task: llmopt_local_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: bleu
    aggregation: bleu
    higher_is_better: true
"""

ROLLING_YAML = """\
task: llmopt_local_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def model(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval") / "llama-long"  # room for MMLU prompts of ~1 token per byte
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (folder / "config.json").write_text(json.dumps(config))
    return load(str(folder))


def _write(tmp_path: Path, name: str, yaml: str, rows: list[dict]) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir(exist_ok=True)
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / f"{name}.yaml").write_text(yaml.format(rows=data), encoding="utf-8")
    return folder


def _run(model, folder: Path, task: str, **kw):
    return lm_eval.simple_evaluate(model=LlmoptLM(model, engine={"kv_cache_memory": 32 * 2**20}), tasks=[task],
                                   task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                                   bootstrap_iters=0, **kw)


def test_local_mmlu_yaml_through_the_adapter_equals_the_built_in_mmlu(model, tmp_path):
    questions = [q for q in load_mmlu(None) if q.subject in ("anatomy", "virology")][:24]
    folder = tmp_path / "tasks"
    write_lm_eval_task(questions, folder, "llmopt_local_mmlu")
    out = _run(model, folder, "llmopt_local_mmlu")

    built_in = evaluate_mmlu(questions, lambda pairs: loglikelihoods(model, pairs))
    assert out["results"]["llmopt_local_mmlu"]["acc,none"] == pytest.approx(built_in.overall.acc)
    samples = sorted(out["samples"]["llmopt_local_mmlu"], key=lambda s: s["doc_id"])
    ours = [s["resps"][i][0][0] for s in samples for i in range(4)]
    want = [x for row in built_in_loglikelihoods(model, questions) for x in row]
    assert ours == pytest.approx(want, abs=1e-6)  # the same four log-likelihoods per question


def built_in_loglikelihoods(model, questions):
    from llmopt.eval.metrics.mmlu import build_requests

    pairs = [(r.context, c) for r in build_requests(questions) for c in r.continuations]
    flat = loglikelihoods(model, pairs)
    return [flat[i:i + 4] for i in range(0, len(flat), 4)]


def test_a_generate_until_task_runs_on_the_paged_runtime(model, tmp_path):
    rows = [{"question": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(5)]
    folder = _write(tmp_path, "gen", GEN_YAML, rows)
    out = _run(model, folder, "llmopt_local_generate")
    samples = out["samples"]["llmopt_local_generate"]
    assert len(samples) == 5
    texts = [s["resps"][0][0] for s in samples]
    assert all(isinstance(t, str) and "\n" not in t for t in texts)
    # greedy through the runtime: the same as generating each prompt alone with the engine
    from llmopt.runtime import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory=32 * 2**20)
    for s, text in zip(samples, texts):
        ids = model.tokenizer.encode(s["arguments"][0][0], add_special_tokens=False)  # (context, gen_kwargs)
        alone = llm.generate([ids], [SamplingParams(max_tokens=6, temperature=0.0, stop=["\n"])])[0].outputs[0].text
        assert text == alone


def test_rolling_loglikelihood_is_the_whole_documents_log_probability(model, tmp_path):
    texts = ["The quick brown fox jumps over the lazy dog.", "Tiny models know nothing."]
    folder = _write(tmp_path, "rolling", ROLLING_YAML, [{"text": t} for t in texts])
    out = _run(model, folder, "llmopt_local_rolling")
    samples = sorted(out["samples"]["llmopt_local_rolling"], key=lambda s: s["doc_id"])
    eos = model.tokenizer.eos_token_ids[0]
    for s, text in zip(samples, texts):
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        full = LlmoptLM(model).loglikelihood_rolling([_Req(text)])[0]
        hf = _by_hand(model, [eos, *ids])
        assert full == pytest.approx(hf, abs=1e-4)
        assert s["resps"][0][0] == pytest.approx(hf, abs=1e-4)


class _Req:
    def __init__(self, *args):
        self.args = args


def _by_hand(model, ids: list[int]) -> float:
    """sum_i log p(ids[i] | ids[:i]) for i >= 1, one plain forward of our decoder."""
    from llmopt.model.attention import EqualLengthAttention

    with torch.inference_mode():
        t = torch.tensor(ids)
        hidden = model.model(t, torch.arange(len(ids)), EqualLengthAttention(1, len(ids)))
        logp = torch.log_softmax(model.model.compute_logits(hidden).double(), dim=-1)
    return float(sum(logp[i - 1, ids[i]] for i in range(1, len(ids))))


def test_cli_lm_eval_tasks_from_an_include_path_equal_the_built_in_mmlu(model, tmp_path):
    """`llmopt eval MODEL --tasks lm-eval:TASK --lm-eval-include-path DIR`: lm-eval's schema in --output, its
    per-task sample JSONL, and the same accuracy as the built-in MMLU on the same rows."""
    from conftest import run_cli

    questions = [q for q in load_mmlu(None) if q.subject in ("anatomy", "virology")][:12]
    folder = tmp_path / "tasks"
    write_lm_eval_task(questions, folder, "llmopt_local_mmlu")
    spec = str(model.source.path)
    code, err, out = run_cli("eval", spec, "--tasks", "lm-eval:llmopt_local_mmlu", "--lm-eval-include-path",
                             str(folder), "--output", str(tmp_path / "lm.json"), "--log-samples", "--json")
    assert code == 0, err
    assert "lm-eval llmopt_local_mmlu: acc " in err  # the summary line (stderr under --json)
    doc = json.loads((tmp_path / "lm.json").read_text())
    entry = doc["results"]["llmopt_local_mmlu"]
    assert {"alias", "acc,none", "acc_stderr,none"} <= set(entry)
    assert doc["n-shot"]["llmopt_local_mmlu"] == 0 and doc["higher_is_better"]["llmopt_local_mmlu"]["acc"] is True
    samples = Path(doc["llmopt"]["samples_files"]["llmopt_local_mmlu"]).read_text().splitlines()
    assert len(samples) == len(questions) and "resps" in json.loads(samples[0])
    # built-in and lm-eval tasks in one run: one JSON, both in results, llmopt's gates beside
    code, err, out = run_cli("eval", spec, "--tasks", "mmlu,lm-eval:llmopt_local_mmlu", "--lm-eval-include-path",
                             str(folder), "--mmlu-path", str(folder / "llmopt_local_mmlu.jsonl"), "--no-cache", "--json")
    assert code == 0, err
    both = json.loads(out)
    assert both["results"]["mmlu"]["acc,none"] == pytest.approx(entry["acc,none"])
    assert both["results"]["llmopt_local_mmlu"]["acc,none"] == entry["acc,none"]
    assert both["n-shot"]["mmlu"] == 0 and "llmopt_local_mmlu" in both["higher_is_better"]
    assert both["llmopt"]["gates"] == [] and both["llmopt"]["exit_code"] == 0


def test_cli_unknown_lm_eval_task_is_one_line(model, tmp_path):
    from conftest import assert_usage_error

    assert_usage_error(["eval", str(model.source.path), "--tasks", "lm-eval:no_such_task_xyz",
                        "--lm-eval-include-path", str(tmp_path)], "no_such_task_xyz")
