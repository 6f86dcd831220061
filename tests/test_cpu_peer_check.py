"""scripts/cpu_peer_check.py's verdicts from bench latency / bench serve documents: the right rows
meet the right targets (the runs themselves are the benchmark, not a test)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "cpu_peer_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("cpu_peer_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def ours(batch: int, tg: float, pp: float, mbu: float = 0.6) -> dict:
    return {"label": f"llmopt (awq w4 g64), batch {batch}", "engine": "llmopt", "batch_size": batch,
            "tg_tok_s": tg, "pp_tok_s": pp, "mbu": mbu, "decode_step_ms": batch * 1e3 / tg,
            "read_bandwidth_gb_s": 35.0}


def llama(tg_fresh: float, tg_deep: float, pp: float) -> list[dict]:
    label = "llama.cpp llama-bench (0.3.36 native), m.gguf, 2 threads: "
    return [{"label": label + "pp512, tg128", "engine": "llama.cpp", "batch_size": 1, "pp_tok_s": pp,
             "tg_tok_s": tg_fresh},
            {"label": label + "tg128 @ d512", "engine": "llama.cpp", "batch_size": 1, "pp_tok_s": None,
             "tg_tok_s": tg_deep}]


def documents(fp32_pp: float = 1_900.0, deep_q40: float = 160.0, b8_mbu: float = 0.61) -> dict[str, dict]:
    """A run where every item holds at the defaults (figures like a real run's)."""
    return {
        "awq-q4_1": {"runs": [ours(1, 241.3, 1_970.8, 0.79), ours(8, 573.5, 1_400.0, b8_mbu),
                              *llama(153.7, 119.4, 351.5)]},
        "q4_0": {"runs": llama(230.0, deep_q40, 885.0)},
        "fp32": {"runs": [ours(1, 54.0, fp32_pp), ours(8, 218.0, 1_495.0)]},
        "awq-short": {"runs": [ours(1, 335.4, 800.0)]},
        "awq-fp16kv": {"runs": [ours(1, 290.0, 1_930.0, 0.86), ours(8, 746.0, 1_970.0, 0.51)]},
        "awq-fp16kv-short": {"runs": [ours(1, 342.0, 820.0)]},
    }


def verdicts(lines) -> dict[str, bool | None]:
    return {line.item.split(":")[0].split(" >=")[0]: line.holds for line in lines}


def test_every_item_holds_on_a_passing_run(check):
    got = verdicts(check.latency_lines(documents()))
    assert got == {"tg128 at ~0 context": True, "tg128 after 512 tokens": True, "pp512 int4 (AWQ)": True,
                   "pp512 fp32": True, "MBU batch 1 after 512": True, "MBU batch 8": True}


def test_decode_after_512_is_against_llama_benchs_deep_row(check):
    # 241.3 / 190 = 1.27x against the tg128 @ d512 row; the ~0-context line keeps the fresh row (1.46x)
    got = verdicts(check.latency_lines(documents(deep_q40=190.0)))
    assert got["tg128 after 512 tokens"] is False
    assert got["tg128 at ~0 context"] is True


def test_prefill_needs_both_the_ratio_and_the_rate(check):
    # 1,540.6 tok/s is over 1,500 but 1.74x llama-bench Q4_0's 885
    assert verdicts(check.latency_lines(documents(fp32_pp=1_540.6)))["pp512 fp32"] is False
    # 2x Q4_0 with a slower peer, but under 1,500 tok/s
    docs = documents(fp32_pp=1_450.0)
    docs["q4_0"] = {"runs": llama(230.0, 160.0, 700.0)}
    docs["awq-q4_1"]["runs"][-2]["pp_tok_s"] = 300.0
    assert verdicts(check.latency_lines(docs))["pp512 fp32"] is False


def test_mbu_and_the_bf16_peer_line(check):
    docs = documents(b8_mbu=0.39)
    docs["bf16"] = {"runs": llama(112.0, 88.7, 1_030.7)}
    lines = check.latency_lines(docs)
    assert verdicts(lines)["MBU batch 8"] is False
    bf16 = lines[-1]
    assert bf16.holds is None and "1,900.0 vs 1,030.7 tok/s, 1.84x" in bf16.figure


def test_a_run_without_llama_bench_stops_with_the_reason(check, capsys):
    docs = documents()
    docs["q4_0"] = {"runs": [{"label": "llama.cpp", "engine": "llama.cpp", "skipped": "not installed (llama_cpp)"}]}
    with pytest.raises(SystemExit) as stopped:
        check.latency_lines(docs)
    assert stopped.value.code == 2 and "not installed (llama_cpp)" in capsys.readouterr().err


def test_serving_needs_the_ratio_at_the_top_and_ttft_at_every_level(check):
    rows = [{"label": f"concurrency={c}", "llmopt_tok_s": a, "llama_server_tok_s": b, "ratio": a / b,
             "llmopt_ttft_ms": t, "llama_server_ttft_ms": u, "failed": [0, 0]}
            for c, a, b, t, u in ((1, 259.8, 126.8, 33.9, 60.6), (4, 588.7, 186.9, 46.5, 106.5),
                                  (16, 820.4, 240.3, 166.1, 280.0))]
    assert check.serving_line(rows).holds is True
    rows[1]["llmopt_ttft_ms"] = 110.0
    assert check.serving_line(rows).holds is False
    rows[1]["llmopt_ttft_ms"] = 46.5
    rows[2]["ratio"] = 1.4
    assert check.serving_line(rows).holds is False
