"""MMLU: lm-eval's prompt, scoring and aggregation, checked on fabricated models with known answers."""

from __future__ import annotations

import gzip
import json
import math
from collections import Counter
from pathlib import Path

import pytest

from llmopt.errors import LlmoptError
from llmopt.eval.metrics import mmlu
from llmopt.eval.metrics.mmlu import (
    GROUPS,
    SUBJECTS,
    MMLUQuestion,
    apply_limit,
    build_requests,
    evaluate_mmlu,
    load_mmlu,
    score_mmlu,
)


def q(subject: str, answer: int, text: str = "Q?") -> MMLUQuestion:
    return MMLUQuestion(subject=subject, question=text, choices=("w", "x", "y", "z"), answer=answer)


def record(subject="anatomy", question="Which bone?", choices=("a", "b", "c", "d"), answer=2) -> dict:
    return {"subject": subject, "question": question, "choices": list(choices), "answer": answer}


def write_jsonl(path: Path, records: list) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def oracle(questions):
    """A fabricated model that knows every answer: it finds the question at the end of the context."""
    answers = {mmlu.format_question(x): x.answer for x in questions}

    def fn(pairs):
        out = []
        for context, continuation in pairs:
            known = next(a for text, a in answers.items() if context.endswith(text))
            out.append(0.0 if continuation == mmlu.CONTINUATIONS[known] else -5.0)
        return out

    return fn


def always_a(pairs):
    return [-1.0 if continuation == " A" else -2.0 for _, continuation in pairs]


# ---------------------------------------------------------------------------- prompts


def test_zero_shot_prompt_is_lm_evals():
    question = MMLUQuestion(
        subject="high_school_us_history",
        question="  Who wrote the Declaration of Independence?\n",
        choices=("Thomas Jefferson", "George Washington", "John Adams ", "Benjamin Franklin"),
        answer=0,
    )
    [request] = build_requests([question])
    assert request.context == (
        "The following are multiple choice questions (with answers) about high school us history.\n\n"
        "Who wrote the Declaration of Independence?\n"
        "A. Thomas Jefferson\n"
        "B. George Washington\n"
        "C. John Adams \n"  # lm-eval strips the question, not the choices
        "D. Benjamin Franklin\n"
        "Answer:"
    )
    assert request.continuations == (" A", " B", " C", " D")


def test_one_shot_prompt_uses_the_first_dev_example_of_the_subject():
    dev = [
        MMLUQuestion("philosophy", "Who wrote Meditations?", ("Kant", "Hume", "Descartes", "Locke"), 2),
        MMLUQuestion("abstract_algebra", "Find the order of Z_4.", ("1", "2", "3", "4"), 3),
        MMLUQuestion("abstract_algebra", "A second dev question", ("p", "q", "r", "s"), 0),
    ]
    question = MMLUQuestion("abstract_algebra", "Is Z_5 a field?", ("Yes", "No", "Only mod 2", "Undefined"), 0)
    [request] = build_requests([question], num_fewshot=1, dev=dev)
    assert request.context == (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find the order of Z_4.\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer: D\n\n"
        "Is Z_5 a field?\nA. Yes\nB. No\nC. Only mod 2\nD. Undefined\nAnswer:"
    )
    [two] = build_requests([question], num_fewshot=2, dev=dev)
    assert two.context.count("Answer: ") == 2
    assert "Answer: D\n\nA second dev question\nA. p\nB. q\nC. r\nD. s\nAnswer: A\n\nIs Z_5" in two.context


def test_fewshot_needs_dev_examples():
    with pytest.raises(LlmoptError, match="needs MMLU's dev split"):
        build_requests([q("anatomy", 0)], num_fewshot=1)
    with pytest.raises(LlmoptError, match="only 1 examples for anatomy"):
        build_requests([q("anatomy", 0)], num_fewshot=2, dev=[q("anatomy", 1)])
    with pytest.raises(LlmoptError, match="non-negative"):
        build_requests([q("anatomy", 0)], num_fewshot=-1)


# ---------------------------------------------------------------------------- scoring


# abstract_algebra, anatomy: stem; philosophy: humanities. Answers chosen so that "always A"
# gets 2/4, 2/2 and 1/3 right.
FABRICATED = (
    [q("abstract_algebra", a, f"aa{i}") for i, a in enumerate([0, 1, 0, 2])]
    + [q("philosophy", a, f"ph{i}") for i, a in enumerate([0, 3, 3])]
    + [q("anatomy", a, f"an{i}") for i, a in enumerate([0, 0])]
)


def test_oracle_scores_one():
    result = evaluate_mmlu(FABRICATED, oracle(FABRICATED))
    assert result.overall.acc == 1.0 and result.overall.n == 9
    assert result.correct == [1] * 9
    assert result.predicted == [x.answer for x in FABRICATED]
    assert all(s.acc == 1.0 and s.acc_stderr == 0.0 for s in result.subjects.values())


def test_always_a_accuracy_and_stderr_by_hand():
    result = evaluate_mmlu(FABRICATED, always_a)
    assert result.correct == [1, 0, 1, 0, 1, 0, 0, 1, 1]
    assert result.predicted == [0] * 9
    subjects = result.subjects
    assert list(subjects) == ["abstract_algebra", "anatomy", "philosophy"]
    # per subject: acc = p, stderr = sqrt(p(1-p)/(n-1))
    assert subjects["abstract_algebra"].acc == 0.5 and subjects["abstract_algebra"].n == 4
    assert subjects["abstract_algebra"].acc_stderr == pytest.approx(math.sqrt(0.25 / 3))  # 0.288675
    assert subjects["anatomy"].acc == 1.0 and subjects["anatomy"].acc_stderr == 0.0
    assert subjects["philosophy"].acc == pytest.approx(1 / 3)
    assert subjects["philosophy"].acc_stderr == pytest.approx(1 / 3)  # sqrt((1/3)(2/3)/2)

    # groups: weighted by document count (stem = 4/6, not the mean of 0.5 and 1.0)
    assert list(result.groups) == ["stem", "humanities"]
    stem, humanities = result.groups["stem"], result.groups["humanities"]
    assert stem.n == 6 and stem.acc == pytest.approx(4 / 6)
    assert humanities.n == 3 and humanities.acc == pytest.approx(1 / 3)
    # pooled stderr (lm-eval): sqrt(sum((n_i-1) se_i^2 n_i) / (N - k) / N)
    # stem: (3 * 1/12 * 4 + 1 * 0 * 2) / (6 - 2) = 1/4  -> sqrt(1/4 / 6) = sqrt(1/24)
    assert stem.acc_stderr == pytest.approx(math.sqrt(1 / 24))  # 0.204124
    # humanities (one subject): (2 * 1/9 * 3) / (3 - 1) = 1/3 -> sqrt(1/3 / 3) = 1/3
    assert humanities.acc_stderr == pytest.approx(1 / 3)
    # overall: acc 5/9; stderr pools the groups: (5 * 1/24 * 6 + 2 * 1/9 * 3) / (9 - 2) = 23/84
    assert result.overall.n == 9 and result.overall.acc == pytest.approx(5 / 9)
    assert result.overall.acc_stderr == pytest.approx(math.sqrt(23 / 84 / 9))  # 0.174423


def test_ties_pick_the_first_choice_and_bad_rows_are_rejected():
    result = score_mmlu([q("anatomy", 1), q("anatomy", 0)], [[0.0, 0.0, -1.0, -1.0], [-3.0, -1.0, -1.0, -2.0]])
    assert result.predicted == [0, 1] and result.correct == [0, 0]
    assert result.subjects["anatomy"].acc_stderr == 0.0
    with pytest.raises(ValueError):
        score_mmlu([q("anatomy", 1)], [[0.0, 0.0, 0.0]])
    with pytest.raises(ValueError):
        score_mmlu([q("anatomy", 1)], [])
    with pytest.raises(ValueError, match="returned 3 values for 4"):
        evaluate_mmlu([q("anatomy", 1)], lambda pairs: [0.0, 0.0, 0.0])


def test_one_question_subject_has_no_stderr():
    result = score_mmlu([q("anatomy", 0), q("philosophy", 0), q("philosophy", 1)], [[0, -1, -1, -1]] * 3)
    assert result.subjects["anatomy"].acc_stderr is None
    assert result.groups["stem"].acc_stderr is None and result.overall.acc_stderr is None
    assert result.groups["humanities"].acc_stderr == pytest.approx(0.5)
    assert result.lm_eval_results()["mmlu"]["acc_stderr,none"] == "N/A"


def test_loglikelihood_fn_gets_four_pairs_per_question_in_order():
    seen = []

    def fn(pairs):
        seen.extend(pairs)
        return [0.0] * len(pairs)

    evaluate_mmlu(FABRICATED[:2], fn)
    contexts = [c for c, _ in seen]
    assert [cont for _, cont in seen] == [" A", " B", " C", " D"] * 2
    assert contexts[:4] == [contexts[0]] * 4 and contexts[0].endswith("aa0\nA. w\nB. x\nC. y\nD. z\nAnswer:")
    assert contexts[4].endswith("aa1\nA. w\nB. x\nC. y\nD. z\nAnswer:")


def test_limit_is_per_subject():
    questions = [q("anatomy", 0, f"an{i}") for i in range(5)] + [q("virology", 0, f"vi{i}") for i in range(3)]
    assert [x.question for x in apply_limit(questions, 2)] == ["an0", "an1", "vi0", "vi1"]
    assert [x.question for x in apply_limit(questions, 0.5)] == ["an0", "an1", "an2", "vi0", "vi1"]  # ceil
    assert apply_limit(questions, None) == questions
    assert evaluate_mmlu(questions, always_a, limit=1).overall.n == 2
    with pytest.raises(LlmoptError, match="--limit"):
        apply_limit(questions, 0)


def test_result_is_plain_json():
    result = evaluate_mmlu(FABRICATED, always_a)
    data = json.loads(json.dumps(result.to_dict(samples=True)))
    assert data["acc"] == pytest.approx(5 / 9) and data["n"] == 9 and data["num_fewshot"] == 0
    assert data["groups"]["stem"]["n"] == 6
    assert data["subjects"]["philosophy"] == {"acc": pytest.approx(1 / 3), "acc_stderr": pytest.approx(1 / 3),
                                              "n": 3, "group": "humanities"}
    assert data["correct"] == result.correct
    assert "correct" not in result.to_dict()
    lm = result.lm_eval_results()
    assert list(lm) == ["mmlu", "mmlu_stem", "mmlu_abstract_algebra", "mmlu_anatomy", "mmlu_humanities",
                        "mmlu_philosophy"]
    assert lm["mmlu_stem"] == {"alias": " - stem", "acc,none": pytest.approx(4 / 6),
                               "acc_stderr,none": pytest.approx(math.sqrt(1 / 24))}


# ---------------------------------------------------------------------------- data


def test_subject_map_matches_lm_eval():
    assert len(SUBJECTS) == 57
    assert Counter(SUBJECTS.values()) == {"stem": 19, "other": 13, "humanities": 13, "social_sciences": 12}
    assert set(GROUPS) == set(SUBJECTS.values())


def test_bundled_subset():
    questions = load_mmlu(None)
    counts = Counter(x.subject for x in questions)
    assert len(questions) >= 1000 and set(counts) == set(SUBJECTS)
    assert set(counts.values()) == {20}
    assert load_mmlu("bundled") == questions
    result = evaluate_mmlu(questions, always_a)
    assert result.overall.n == len(questions) and len(result.subjects) == 57 and len(result.groups) == 4
    # every prediction is A, so accuracy is the share of answer 0
    assert result.overall.acc == pytest.approx(sum(x.answer == 0 for x in questions) / len(questions))
    # the whole dev split ships too, so 5-shot works offline (lm-eval's first_n: a subject's dev rows in order)
    dev = load_mmlu(None, "dev")
    assert Counter(x.subject for x in dev) == {s: 5 for s in SUBJECTS}
    algebra = next(x for x in questions if x.subject == "abstract_algebra")
    [request] = build_requests([algebra], num_fewshot=5, dev=dev)
    assert request.context.count("\nAnswer:") == 6
    assert request.context.startswith("The following are multiple choice questions (with answers) about abstract "
                                      "algebra.\n\nFind all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\nA. 0\n")
    assert "\nD. 3\nAnswer: B\n\n" in request.context  # its answer is 1: " B"
    with pytest.raises(LlmoptError, match="only 5 examples"):
        build_requests([algebra], num_fewshot=6, dev=dev)


def test_bundled_licence_ships_with_the_data():
    text = (mmlu.DATA_DIR / "MMLU_LICENSE.txt").read_text()
    assert "MIT License" in text and "Hendrycks" in text


def test_bundled_oracle_end_to_end():
    questions = apply_limit(load_mmlu(None), 2)
    result = evaluate_mmlu(questions, oracle(questions))
    assert result.overall.acc == 1.0 and result.overall.n == 114


@pytest.mark.parametrize("name", ["test.jsonl", "test.jsonl.gz", "test.json", "test.parquet"])
def test_local_files(tmp_path, name):
    records = [record(), record(subject="virology", question="What is a virus?", answer=0)]
    path = tmp_path / name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    elif name.endswith(".json"):
        path.write_text(json.dumps(records))
    else:
        write_jsonl(path, records)
    questions = load_mmlu(str(path))
    assert questions == [
        MMLUQuestion("anatomy", "Which bone?", ("a", "b", "c", "d"), 2),
        MMLUQuestion("virology", "What is a virus?", ("a", "b", "c", "d"), 0),
    ]


def test_dev_split_beside_a_local_file(tmp_path):
    test = write_jsonl(tmp_path / "test.jsonl.gz", [record()])
    with pytest.raises(LlmoptError, match="no MMLU dev split in"):
        load_mmlu(test, split="dev")
    write_jsonl(tmp_path / "dev.jsonl.gz", [record(question="Dev one", answer=1), record(question="Dev two")])
    dev = load_mmlu(test, split="dev")
    assert [x.question for x in dev] == ["Dev one", "Dev two"]
    assert load_mmlu(tmp_path, split="dev") == dev and load_mmlu(tmp_path) == load_mmlu(test)  # a folder works too
    result = evaluate_mmlu(load_mmlu(test), always_a, num_fewshot=1, dev=dev)
    assert result.num_fewshot == 1 and result.to_dict()["num_fewshot"] == 1


def test_hub_snapshot_layout(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([record()]), tmp_path / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist([record(question="D")]), tmp_path / "dev-00000-of-00001.parquet")
    assert load_mmlu(tmp_path / "test-00000-of-00001.parquet", "dev")[0].question == "D"


# ---------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl.gz"
    with pytest.raises(LlmoptError, match="does not exist") as e:
        load_mmlu(str(missing))
    assert str(missing) in str(e.value)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({k: v for k, v in record().items() if k != "answer"}, "has no answer column"),
        ({"text": "x", "label": 1}, "has no subject, question, choices, answer column"),
        (record(answer=4), "answer must be an integer 0-3"),
        (record(answer=-1), "answer must be an integer 0-3"),
        (record(answer="B"), "answer must be an integer 0-3"),
        (record(answer=True), "answer must be an integer 0-3"),
        (record(choices=("a", "b", "c")), "choices must be a list of 4 strings"),
        (record(subject="astrology"), "unknown subject 'astrology'"),
        (record(question=None), "question must be a string"),
        ([1, 2, 3], "not an object"),
    ],
)
def test_bad_records(tmp_path, bad, fragment):
    path = write_jsonl(tmp_path / "test.jsonl", [record(), bad])
    with pytest.raises(LlmoptError, match=fragment) as e:
        load_mmlu(path)
    assert f"{path}: record 2" in str(e.value)


def test_bad_files(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"subject": "anatomy"\n')
    with pytest.raises(LlmoptError, match="line 1 is not valid JSON"):
        load_mmlu(tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(LlmoptError, match="holds no questions"):
        load_mmlu(tmp_path / "empty.jsonl")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(LlmoptError, match="unsupported MMLU file type"):
        load_mmlu(tmp_path / "data.csv")
    (tmp_path / "fake.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(LlmoptError, match="cannot read"):
        load_mmlu(tmp_path / "fake.jsonl.gz")
    (tmp_path / "obj.json").write_text('{"questions": []}')
    with pytest.raises(LlmoptError, match="expected a JSON list"):
        load_mmlu(tmp_path / "obj.json")
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(LlmoptError, match="cannot read"):
        load_mmlu(tmp_path / "fake.parquet")


def test_parquet_without_expected_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist([{"subject": "anatomy", "question": "q", "choices": ["a"] * 4}]), path)
    with pytest.raises(LlmoptError, match="has no answer column; expected the cais/mmlu schema"):
        load_mmlu(path)


def test_hub_unreachable_offline():
    # conftest sets HF_HUB_OFFLINE=1; an unknown name fails online too, so this never downloads
    with pytest.raises(LlmoptError) as e:
        load_mmlu("hf:llmopt-test/no-such-mmlu")
    message = str(e.value)
    assert "hf:llmopt-test/no-such-mmlu:all" in message and "--mmlu-path" in message and "bundled" in message


def test_contexts_get_bos_as_lm_eval_adds_it():
    """lm-eval's add_bos_token: BOS before every context where the tokenizer adds one by default
    (`--add-bos/--no-add-bos` override); the continuation's tokens are unchanged."""
    from tokenizers import processors

    from conftest import make_byte_tokenizer
    from llmopt.core.tokenizer import Tokenizer
    from llmopt.eval.metrics.loglikelihood import encode_pairs
    from llmopt.eval.metrics.text import context_bos_id

    plain = Tokenizer(backend=make_byte_tokenizer(), bos_token="<|im_start|>", eos_token="<|im_end|>")
    backend = make_byte_tokenizer()
    bos = backend.token_to_id("<|im_start|>")
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    adding = Tokenizer(backend=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert context_bos_id(plain, None) is None and context_bos_id(adding, None) == bos
    assert context_bos_id(adding, False) is None and context_bos_id(plain, True) == bos
    pairs = [("Question: 2+2?\nAnswer:", " 4")]
    [(ctx, cont)] = encode_pairs(adding, pairs, context_bos_id(adding, None))
    [(ctx_plain, cont_plain)] = encode_pairs(plain, pairs)
    assert ctx == [bos, *ctx_plain] and cont == cont_plain
    # what lm-eval's HFLM encodes with add_special_tokens (the tokenizer's default): the same ids
    whole = adding.encode(pairs[0][0] + pairs[0][1], add_special_tokens=True)
    assert whole == ctx + cont
    with pytest.raises(LlmoptError, match="no BOS"):
        context_bos_id(Tokenizer(backend=make_byte_tokenizer()), True)
