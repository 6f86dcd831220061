"""Engine APIs: per-request validation, seeded sampling across batches, stops, async streaming and abort."""

from __future__ import annotations

import asyncio

import pytest

from llmopt.loader import load
from llmopt.errors import LlmoptError
from llmopt.runtime import SamplingParams
from llmopt.runtime.async_engine import AsyncLLM
from llmopt.runtime.llm import LLM


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return load(str(tiny_models["llama"]), dtype="float32")


def make_llm(tiny, **kw):
    return LLM(tiny, num_kv_blocks=kw.pop("num_kv_blocks", 256), max_model_len=kw.pop("max_model_len", 128), **kw)


def test_bad_requests_rejected_alone(tiny):
    llm = make_llm(tiny)
    prompts = ["hello there", "", list(range(5, 200)), "the cat", [999999]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.error is None for o in outs] == [True, False, False, True, False]
    assert "empty" in outs[1].error
    assert "max_model_len" in outs[2].error
    assert "outside the vocabulary" in outs[4].error
    assert all(len(o.outputs[0].token_ids) == 8 for o in (outs[0], outs[3]))
    with pytest.raises(LlmoptError, match="lower max_tokens to at most"):
        llm.engine.add_request([5] * 100, SamplingParams(max_tokens=100))


def test_seeded_sampling_independent_of_batch(tiny):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_llm(tiny).generate(["the quick brown fox"], params)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in (3, 20, 9)]
    batch = make_llm(tiny, max_num_batched_tokens=8).generate(
        ["zzz", "in the beginning", "the quick brown fox", "x y z"], [others[0], others[1], params, others[2]]
    )
    assert batch[2].outputs[0].token_ids == alone


def test_stop_token_ids_stop_strings_and_min_tokens(tiny):
    llm = make_llm(tiny)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full = llm.generate(["the"], greedy)[0].outputs[0]
    stop_id = full.token_ids[5]
    out = llm.generate(["the"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                               stop_token_ids=[stop_id]))[0].outputs[0]
    first = full.token_ids.index(stop_id)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens suppresses the stop token until enough tokens exist
    late = llm.generate(["the"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, min_tokens=first + 2,
                                                stop_token_ids=[stop_id]))[0].outputs[0]
    assert stop_id not in late.token_ids[: first + 2]
    # a stop string cuts the text
    piece = full.text[3:6]
    if piece:
        cut = llm.generate(["the"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[piece]))[0]
        assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == piece
        assert cut.outputs[0].text == full.text[: full.text.index(piece)]


def test_logprobs(tiny):
    llm = make_llm(tiny)
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) == 3  # greedy: the chosen token is the top-1
        assert max(lp.values()) == lp[token] <= 0.0


def test_async_streaming_and_abort_frees_blocks(tiny):
    async def main():
        engine = AsyncLLM.from_spec(tiny, num_kv_blocks=256, max_model_len=128)
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

        async def full(prompt):
            texts, last = [], None
            async for out in engine.generate(prompt, params):
                texts.append(out.outputs[0].new_text)
                last = out
            return "".join(texts), last

        async def abandon(prompt):
            got = 0
            async for _ in engine.generate(prompt, params, request_id="victim"):
                got += 1
                if got == 5:
                    break  # the client goes away mid-stream
            return got

        (text, last), got = await asyncio.gather(full("the cat sat"), abandon("a dog ran"))
        assert got == 5
        assert last.finished and len(last.outputs[0].token_ids) == 50
        assert text == last.outputs[0].text
        stats = engine.stats()
        assert stats.num_requests_running == 0 and stats.num_requests_waiting == 0
        assert stats.kv_cache_usage_perc == 0.0  # the aborted request's blocks are back in the pool
        assert "victim" not in engine.engine.requests

        # cancelling the consuming task aborts too
        async def consume():
            async for _ in engine.generate("hello world", params, request_id="cancelled"):
                await asyncio.sleep(0)

        task = asyncio.create_task(consume())
        while engine.stats().num_requests_running == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # a task cancelled while it awaits its own code (not the stream) leaves the stream generator to
        # the event loop's async-generator finaliser, which closes it (and aborts) a few turns later
        for _ in range(1000):
            if "cancelled" not in engine.engine.requests:
                break
            await asyncio.sleep(0.01)
        assert "cancelled" not in engine.engine.requests
        assert engine.stats().kv_cache_usage_perc == 0.0

        with pytest.raises(LlmoptError):
            async for _ in engine.generate("", params):
                pass
        engine.shutdown()

    asyncio.run(main())


def test_async_step_exception_fails_waiting_requests_then_serves_on(tiny):
    async def main():
        engine = AsyncLLM.from_spec(tiny, num_kv_blocks=256, max_model_len=128)
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        real_step, calls = engine.engine.step, 0

        def flaky_step():
            nonlocal calls
            calls += 1
            if calls == 5:
                raise RuntimeError("boom")
            return real_step()

        engine.engine.step = flaky_step

        async def run(prompt):
            return [out async for out in engine.generate(prompt, params)]

        results = await asyncio.wait_for(asyncio.gather(run("the cat"), run("a dog"), return_exceptions=True), 30)
        assert all(isinstance(r, RuntimeError) and str(r) == "boom" for r in results)
        stats = engine.stats()
        assert stats.num_requests_running == 0 and stats.kv_cache_usage_perc == 0.0 and not engine.engine.requests
        # the engine thread survived: the next request runs to the end
        outs = await asyncio.wait_for(run("the cat"), 30)
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 30
        engine.shutdown()

    asyncio.run(main())


def test_async_engine_thread_idles_without_polling_and_shuts_down(tiny):
    async def main():
        engine = AsyncLLM.from_spec(tiny, num_kv_blocks=256, max_model_len=128)
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        real_check, checks = engine.engine.has_unfinished_requests, 0

        def counted_check():
            nonlocal checks
            checks += 1
            return real_check()

        engine.engine.has_unfinished_requests = counted_check
        await asyncio.sleep(0.2)
        assert checks <= 1  # asleep on its condition, not polling
        stream = engine.generate("the cat", params)
        first = await stream.__anext__()
        assert not first.finished
        engine.shutdown()  # mid-request: the waiting stream ends with an error instead of hanging
        assert not engine._thread.is_alive()
        with pytest.raises(LlmoptError, match="shut down"):
            await asyncio.wait_for(_drain(stream), 10)
        assert not engine.engine.requests and engine.stats().kv_cache_usage_perc == 0.0
        with pytest.raises(LlmoptError, match="shut down"):
            engine.add_request("the cat", params)

    asyncio.run(main())


async def _drain(stream) -> None:
    async for _ in stream:
        pass
