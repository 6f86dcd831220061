"""IncrementalDetokenizer: streaming text from token ids, multi-byte characters, stop strings."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from conftest import make_byte_tokenizer

from llmopt.core.tokenizer import Tokenizer
from llmopt.errors import LlmoptError
from llmopt.runtime.detokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer

TEXTS = [
    "hello world",
    "héllo wörld ✓ 日本語 🙂 emoji",
    "def f(x):\n    if x:\n        return {'a': [1, 2]}\n\treturn None\n",
    "the then thin in inn 🙂🙂🙂 👩‍👩‍👧 ü\n\n  ",
    "🙂",
]


@dataclass
class CountingTokenizer(Tokenizer):
    """Records how many ids every decode call gets."""

    decode_lengths: list[int] = field(default_factory=list)

    def decode(self, ids, skip_special_tokens=True):
        self.decode_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(backend=make_byte_tokenizer())


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], list[bool]]:
    """Feed ids one by one, collecting new_text() after each; stop feeding on a stop match."""
    deltas, stopped = [], []
    for token in ids:
        stopped.append(detok.add_token(token))
        deltas.append(detok.new_text())
        if stopped[-1]:
            break
    deltas.append(detok.new_text(finished=True))
    return deltas, stopped


def check_round_trip(tokenizer: Tokenizer, text: str, prompt: str = "") -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, stopped = stream(detok, ids)
    expected = tokenizer.decode(ids)
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas)
    assert not any(stopped) and detok.stop_reason is None
    assert detok.token_ids == ids


# ---- plain decoding -----------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "User: hi 日本\nAssistant:", "ü"])
def test_round_trip(tok, text, prompt):
    check_round_trip(tok, text, prompt)


def test_incomplete_character_is_held_back(tok):
    ids = tok.encode("a🙂", add_special_tokens=False)
    assert len(ids) == 5  # "a" + the emoji's four bytes
    detok = IncrementalDetokenizer(tok, [])
    for token in ids[:-1]:
        detok.add_token(token)
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == "a"
    detok.add_token(ids[-1])
    assert detok.output_text == "a🙂"


def test_incomplete_character_at_the_end_is_flushed_like_decode(tok):
    ids = tok.encode("a🙂", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, [])
    deltas, _ = stream(detok, ids)
    assert deltas[:-1] == ["a", "", "", ""]
    assert detok.output_text == tok.decode(ids) == "a\ufffd"
    assert "".join(deltas) == detok.output_text
    assert detok.finished


def test_prompt_text_is_not_in_the_output(tok):
    prompt_ids = tok.encode("stay out of the output ✓", add_special_tokens=False)
    ids = tok.encode(" and continue", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas, _ = stream(detok, ids)
    assert detok.output_text == "".join(deltas) == " and continue"


def test_prompt_ending_inside_a_character(tok):
    emoji = tok.encode("🙂", add_special_tokens=False)
    prompt_ids = tok.encode("x", add_special_tokens=False) + emoji[:2]
    generated = emoji[2:] + tok.encode("ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    stream(detok, generated)
    # the character began in the prompt; the generated text is what its own ids decode to
    assert detok.output_text == tok.decode(generated)
    assert detok.output_text.endswith("ok") and "x" not in detok.output_text


def test_invalid_bytes_do_not_grow_the_window(tok):
    lead = tok.encode("日", add_special_tokens=False)[0]  # a UTF-8 lead byte, never completed
    ids = [lead] * (3 * MAX_PENDING_TOKENS) + tok.encode("ok", add_special_tokens=False)
    counting = CountingTokenizer(backend=tok.backend)
    detok = IncrementalDetokenizer(counting, [])
    deltas, _ = stream(detok, ids)
    assert detok.output_text == "".join(deltas) == tok.decode(ids)
    assert max(counting.decode_lengths) <= MAX_PENDING_TOKENS + 1


def test_work_per_token_is_bounded(tok):
    text = "".join(TEXTS) * 30
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    counting = CountingTokenizer(backend=tok.backend)
    detok = IncrementalDetokenizer(counting, tok.encode("prompt", add_special_tokens=False), stop=["never happens"])
    deltas, _ = stream(detok, ids)
    assert detok.output_text == "".join(deltas) == text
    # every decode sees a small window, never the whole output
    assert max(counting.decode_lengths) <= 10
    assert len(counting.decode_lengths) <= 2 * len(ids) + 2


def test_context_keeps_sentencepiece_leading_space():
    """Metaspace decoders strip the first token's leading space; the prompt context avoids that."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    words = ["▁Hello", "▁world", "▁the", "▁end", "<unk>"]
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer = Tokenizer(backend=backend)
    ids = tokenizer.encode("Hello world the end")
    detok = IncrementalDetokenizer(tokenizer, ids[:2])
    deltas, _ = stream(detok, ids[2:])
    assert detok.output_text == "".join(deltas) == " the end"
    without_prompt = IncrementalDetokenizer(tokenizer, [])
    stream(without_prompt, ids[2:])
    assert without_prompt.output_text == "the end"  # what tokenizer.decode gives for these ids alone


# ---- stop strings -----------------------------------------------------------------------
def test_stop_string_truncates(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["three"])
    deltas, stopped = stream(detok, ids)
    assert stopped[-1] and not any(stopped[:-1])
    # the match is reported on the token that completes "three"
    assert tok.decode(ids[: len(stopped)]) == "one two three"
    assert detok.output_text == "".join(deltas) == "one two "
    assert detok.stop_reason == "three"
    assert detok.finished
    # tokens after a stop are ignored
    assert detok.add_token(ids[-1]) is True
    assert detok.output_text == "one two " and detok.new_text() == ""


def test_stop_string_spanning_tokens_and_multibyte(tok):
    text = "café ✓ done ✓✓ tail"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["é ✓ d"])
    deltas, stopped = stream(detok, ids)
    assert sum(stopped) == 1
    assert detok.output_text == "".join(deltas) == "caf"
    assert detok.stop_reason == "é ✓ d"


def test_include_stop_str_in_output(tok):
    ids = tok.encode("say STOP now", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    deltas, stopped = stream(detok, ids)
    assert stopped[-1]
    assert detok.output_text == "".join(deltas) == "say STOP"
    assert detok.stop_reason == "STOP"
    # nothing needs holding back: streamed text is never retracted
    assert "".join(deltas[:-1]) == "say STOP"


def test_prefix_of_stop_string_is_held_back_until_disambiguated(tok):
    stop = ["END"]
    # the "EN" turns out not to be a stop string
    detok = IncrementalDetokenizer(tok, [], stop=stop)
    for token in tok.encode("ab EN", add_special_tokens=False):
        assert not detok.add_token(token)
    assert detok.new_text() == "ab "  # "EN" (len("END") - 1 chars) held back
    assert not detok.add_token(tok.encode("X", add_special_tokens=False)[0])
    assert detok.new_text() == "E"
    assert detok.new_text(finished=True) == "NX"
    assert detok.output_text == "ab ENX" and detok.stop_reason is None

    # ... and here it does
    detok = IncrementalDetokenizer(tok, [], stop=stop)
    for token in tok.encode("ab EN", add_special_tokens=False):
        detok.add_token(token)
    assert detok.new_text() == "ab "
    assert detok.add_token(tok.encode("D", add_special_tokens=False)[0])
    assert detok.new_text() == ""
    assert detok.new_text(finished=True) == ""
    assert detok.output_text == "ab " and detok.stop_reason == "END"


def test_streamed_text_is_never_retracted(tok):
    text = "a STO b ST c STOP d"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    shown = ""
    for token in ids:
        stopped = detok.add_token(token)
        shown += detok.new_text()
        assert detok.output_text.startswith(shown)
        if stopped:
            break
    shown += detok.new_text(finished=True)
    assert shown == detok.output_text == "a STO b ST c "


def test_no_stop_strings_means_no_hold_back(tok):
    detok = IncrementalDetokenizer(tok, [])
    for token in tok.encode("abc", add_special_tokens=False):
        detok.add_token(token)
    assert detok.new_text() == "abc"


def test_earliest_stop_string_wins(tok):
    # one character per token: "llo" completes before "world" even though listed second
    ids = tok.encode("hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["world", "llo"])
    deltas, _ = stream(detok, ids)
    assert detok.output_text == "".join(deltas) == "he" and detok.stop_reason == "llo"

    # both in the same token (" the" is one token): the earliest start wins
    ids = tok.encode("x the", add_special_tokens=False)
    assert len(ids) == 2
    detok = IncrementalDetokenizer(tok, [], stop=["he", " t"])
    stream(detok, ids)
    assert detok.output_text == "x" and detok.stop_reason == " t"

    # same start: the shorter one (it completes first)
    detok = IncrementalDetokenizer(tok, [], stop=["the", "th"], include_stop_str_in_output=True)
    stream(detok, ids)
    assert detok.output_text == "x th" and detok.stop_reason == "th"


def test_stop_string_does_not_match_across_the_prompt(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("say EN", add_special_tokens=False), stop=["END"])
    deltas, stopped = stream(detok, tok.encode("D.", add_special_tokens=False))
    assert not any(stopped) and detok.output_text == "".join(deltas) == "D."


def test_stop_string_validation(tok):
    with pytest.raises(LlmoptError):
        IncrementalDetokenizer(tok, [], stop=[""])
    detok = IncrementalDetokenizer(tok, [], stop="x")  # a single string is accepted
    stream(detok, tok.encode("abxc", add_special_tokens=False))
    assert detok.output_text == "ab"


def test_stop_strings_against_a_reference(tok):
    """Random texts and stop strings: the result equals cutting the full text at the first match."""
    rng = random.Random(0)
    alphabet = "ab ü✓\n日"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        include = rng.random() < 0.5
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        shown = ""
        for token in ids:
            stopped = detok.add_token(token)
            shown += detok.new_text()
            assert detok.output_text.startswith(shown)
            if stopped:
                break
        shown += detok.new_text(finished=True)
        assert shown == detok.output_text
        # reference: for each end position, the first stop string that ends there
        expected, reason = text, None
        for end in range(1, len(text) + 1):
            hits = [(end - len(s), s) for s in stops if text[:end].endswith(s)]
            if hits:
                start, reason = min(hits, key=lambda h: (h[0], len(h[1])))
                expected = text[: start + len(reason)] if include else text[:start]
                break
        assert (detok.output_text, detok.stop_reason) == (expected, reason), (text, stops, include)


# ---- special tokens -----------------------------------------------------------------------
def test_special_tokens_skipped(tok):
    ids = tok.encode("<|im_start|>hi ✓<|im_end|> there<|endoftext|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas, _ = stream(detok, ids)
    assert detok.output_text == "".join(deltas) == tok.decode(ids) == "hi ✓ there"


def test_special_tokens_kept(tok):
    text = "<|im_start|>hi ✓<|im_end|> there<|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    deltas, _ = stream(detok, ids)
    assert detok.output_text == "".join(deltas) == tok.decode(ids, skip_special_tokens=False) == text


def test_stop_string_on_special_token_text(tok):
    ids = tok.encode("hi<|im_end|>more", add_special_tokens=False)
    kept = IncrementalDetokenizer(tok, [], stop=["<|im_end|>"], skip_special_tokens=False)
    stream(kept, ids)
    assert kept.output_text == "hi" and kept.stop_reason == "<|im_end|>"
    skipped = IncrementalDetokenizer(tok, [], stop=["<|im_end|>"])
    stream(skipped, ids)
    assert skipped.output_text == "himore" and skipped.stop_reason is None


def test_add_token_after_finish_raises(tok):
    detok = IncrementalDetokenizer(tok, [])
    detok.add_token(tok.encode("a", add_special_tokens=False)[0])
    assert detok.new_text(finished=True) == "a"
    assert detok.new_text(finished=True) == ""
    with pytest.raises(LlmoptError):
        detok.add_token(0)


# ---- the default model's tokenizer (SmolLM2, byte-level BPE) -----------------------------
@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    from llmopt.loader import load

    return load("default").tokenizer


@pytest.mark.integration
def test_default_model_round_trip(default_tokenizer):
    tokenizer = default_tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say something ünïcödé."}])
    for text in TEXTS:
        check_round_trip(tokenizer, text, prompt)
    # random ids, special tokens and stray bytes included: still exactly tokenizer.decode
    rng = random.Random(0)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    for skip in (True, False):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(500)]
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
        deltas, _ = stream(detok, ids)
        assert detok.output_text == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.integration
def test_default_model_stop_strings(default_tokenizer):
    tokenizer = default_tokenizer
    text = "Paris is the capital of France.\n\nIt is known for the Eiffel Tower 🗼."
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop, include, expected in [
        (["\n\n"], False, "Paris is the capital of France."),
        (["capital of Fr"], False, "Paris is the "),
        (["Tower", "Eiffel"], True, "Paris is the capital of France.\n\nIt is known for the Eiffel"),
        (["🗼"], False, "Paris is the capital of France.\n\nIt is known for the Eiffel Tower "),
    ]:
        detok = IncrementalDetokenizer(tokenizer, [], stop=stop, include_stop_str_in_output=include)
        deltas, stopped = stream(detok, ids)
        assert stopped[-1]
        assert detok.output_text == "".join(deltas) == expected
