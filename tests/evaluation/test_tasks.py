"""Offline eval tasks: generators (sizing, answers, determinism), RULER scoring, custom JSONL tasks."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from sparsetune.errors import SparsetuneError
from sparsetune.evaluation import ruler
from sparsetune.evaluation.custom import load_jsonl
from sparsetune.evaluation.multiturn import POSITIONS
from sparsetune.evaluation.samples import Sample, final_prompt_tokens, gold_replies, turn_messages
from sparsetune.evaluation.scoring import postprocess, score
from sparsetune.evaluation.tasks import DEFAULT_SUITE, TASKS, build_samples, list_tasks, task_size

N = 3  # samples per (task, context): enough for the multiturn rotation to show every position


@pytest.fixture(scope="session")
def tok():
    from sparsetune.models.resolve import resolve_model

    return resolve_model("smollm2-135m").load_tokenizer()


_CACHE: dict[tuple[str, int, int, int], list[Sample]] = {}


def samples(tok, task: str, context: int, n: int = N, seed: int = 0) -> list[Sample]:
    """Generated once per test session: tokenizing is the cost of these tests."""
    key = (task, context, n, seed)
    if key not in _CACHE:
        _CACHE[key] = build_samples(task, tok, context, n, seed)
    return _CACHE[key]


def prompt_text(sample: Sample) -> str:
    """Everything the last turn's prompt says (gold answers as earlier replies), chat template aside."""
    last = len(sample.turns) - 1
    messages = turn_messages(sample, last, gold_replies(sample)[:last])
    return "\n".join(m["content"] for m in messages) + "\n" + sample.turns[last].answer_prefix


SIZES = [(task, context) for task in TASKS for context in (1024, 4096)]
SIZES += [("niah_single", 2048), ("cwe", 2048), ("multiturn", 2048)]


# ---------------------------------------------------------------------------------------------
# Registry


def test_registry_and_listing():
    assert DEFAULT_SUITE + ("rag", "chat", "agent") == tuple(TASKS)  # reuse workloads are asked for by name
    assert set(DEFAULT_SUITE) == {
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "multiturn"
    }
    rows = list_tasks()
    assert [r["name"] for r in rows] == list(TASKS)
    for row in rows:
        assert set(row) == {"name", "family", "description", "max_new_tokens", "metric"}
        assert row["family"] == {"multiturn": "multiturn", "rag": "reuse", "chat": "reuse", "agent": "reuse"}.get(row["name"], "ruler")
        assert row["metric"] == "all" and row["max_new_tokens"] >= 30
        assert 40 < len(row["description"]) < 320 and "\n" not in row["description"]
    assert TASKS["niah_single"].max_new_tokens == 32
    assert TASKS["vt"].max_new_tokens == 30
    assert TASKS["cwe"].max_new_tokens == 64
    assert TASKS["fwe"].max_new_tokens == 50


def test_unknown_task_names_the_known_ones(tok):
    with pytest.raises(SparsetuneError, match=r"unknown task 'niah'; use one of niah_single, .*multiturn"):
        build_samples("niah", tok, 1024, 1, 0)


@pytest.mark.parametrize("task", ["niah_multikey", "cwe", "multiturn"])
def test_too_small_context(tok, task):
    with pytest.raises(SparsetuneError) as e:
        build_samples(task, tok, 64, 1, 0)
    message = str(e.value)
    assert re.fullmatch(rf"--context 64 is too small for {task}: it needs at least \d+ tokens; raise --context", message)
    need = int(re.search(r"(\d+) tokens", message).group(1))
    build_samples(task, tok, need + 16, 1, 0)  # the stated minimum (with the same sample) is enough


# ---------------------------------------------------------------------------------------------
# Generators: sizing, answers, determinism


@pytest.mark.parametrize("task,context", SIZES)
def test_prompt_fills_the_context(tok, task, context):
    for i, sample in enumerate(samples(tok, task, context)):
        assert sample.task == task and sample.index == i
        assert sample.metric == "all" and sample.max_new_tokens == TASKS[task].max_new_tokens
        tokens = final_prompt_tokens(tok, sample)
        assert abs(tokens - context) <= 0.05 * context, (task, context, i, tokens)
        json.dumps(sample.meta)  # run records store it


@pytest.mark.parametrize("task", list(TASKS))
def test_byte_tokenizer_sizes_too(task):
    """Random-weight speed runs count bytes; at 4K cwe falls back to RULER's short-context repeats."""
    from sparsetune.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    for sample in build_samples(task, tok, 4096, 2, 0):
        assert abs(final_prompt_tokens(tok, sample) - 4096) <= 0.05 * 4096
        if task == "cwe":
            assert sample.meta["repeats"] == [6, 1]


@pytest.mark.parametrize("task,context", SIZES)
def test_answers_appear_in_the_prompt(tok, task, context):
    for sample in samples(tok, task, context):
        text = prompt_text(sample).lower()
        for turn in sample.turns:
            assert turn.answers
            for answer in turn.answers:
                assert answer.lower() in text, (task, answer)


@pytest.mark.parametrize("task", list(TASKS))
def test_deterministic_and_independent_of_n(tok, task):
    a = samples(tok, task, 1024)
    assert build_samples(task, tok, 1024, N, 0) == a
    assert [s.meta for s in build_samples(task, tok, 1024, N, 0)] == [s.meta for s in a]
    assert build_samples(task, tok, 1024, 2, 0) == a[:2]  # sample i is drawn from (seed, task, i) alone
    other = build_samples(task, tok, 1024, 2, 1)
    assert other[0] != a[0] and other[1] != a[1]
    assert a[0].turns != a[1].turns


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_niah_needles(tok, task):
    cfg = ruler.NIAH[task]
    for context in (1024, 4096):
        for sample in samples(tok, task, context):
            (turn,) = sample.turns
            needles = sample.meta["needles"]
            assert len(needles) == cfg.keys * cfg.values
            assert len({n["key"] for n in needles}) == cfg.keys
            assert len(sample.meta["query"]) == cfg.queries
            assert len(turn.answers) == cfg.queries * cfg.values
            assert all(n["depth"] in ruler.DEPTHS for n in needles)
            for n in needles:  # every needle (distractors too) sits in the haystack once, verbatim
                assert turn.user.count(ruler.NEEDLE.format(key=n["key"], value=n["value"])) == 1
                assert re.fullmatch(r"[a-z]+-[a-z]+", n["key"]) and re.fullmatch(r"[1-9]\d{6}", n["value"])
            asked = {n["value"] for n in needles if n["key"] in sample.meta["query"]}
            assert set(turn.answers) == asked
            assert turn.answer_prefix.startswith("The special magic number")
            assert sample.meta["query"][-1] in turn.answer_prefix
    single = samples(tok, "niah_single", 1024)[0]
    if task == "niah_single":  # RULER's noise haystack and singular template
        assert ruler.NOISE in single.turns[0].user
        assert single.turns[0].user.startswith("A special magic number is hidden within the following text.")
        assert single.turns[0].answer_prefix.endswith("mentioned in the provided text is")
        assert single.meta["depth"] == single.meta["needles"][0]["depth"]


def test_niah_needle_depth_follows_the_haystack(tok):
    """A needle at depth d has about d% of the haystack lines before it."""
    for sample in samples(tok, "niah_single", 4096):
        lines = sample.turns[0].user.split("\n")[1:-1]
        at = next(i for i, line in enumerate(lines) if line.startswith("One of the special"))
        assert at == sample.meta["units"] * sample.meta["depth"] // 100


def test_vt_chain(tok):
    for sample in samples(tok, "vt", 4096):
        (turn,) = sample.turns
        names, value = turn.answers, sample.meta["value"]
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        task_text = turn.user[turn.user.rindex("Memorize and track") :]  # after the solved example
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(4)]
        found = [line for line in task_text.split("\n") if line.startswith("VAR ")]
        assert found == chain  # in order
        assert f"assigned the value {value} in the text above" in task_text
        assert turn.answer_prefix.endswith(f"5 variables are assigned the value {value}, they are:")
        assert turn.user.count("Memorize and track") == 2  # one solved example first


@pytest.mark.parametrize("context,repeats", [(1024, [6, 1]), (4096, [30, 3])])
def test_cwe_counts(tok, context, repeats):
    vocabulary = set(ruler.words().vocabulary)
    for sample in samples(tok, "cwe", context):
        (turn,) = sample.turns
        assert sample.meta["repeats"] == repeats
        listing = turn.user[turn.user.rindex("Below is a numbered list") :].split("\n")[1]
        entries = re.findall(r"(\d+)\. (\S+)", listing)
        assert [int(k) for k, _ in entries] == list(range(1, len(entries) + 1))
        counts = Counter(w for _, w in entries)
        assert len(counts) == sample.meta["words"] and set(counts) <= vocabulary
        assert {w for w, c in counts.items() if c == repeats[0]} == set(turn.answers)
        assert all(c == repeats[1] for w, c in counts.items() if w not in turn.answers)
        assert len(turn.answers) == 10


def test_cwe_long_context_uses_pairs_when_the_vocabulary_runs_out(tok):
    (sample,) = build_samples("cwe", tok, 32768, 1, 0)
    assert sample.meta["vocabulary"] == "pairs"
    assert all(re.fullmatch(r"[a-z]+-[a-z]+", w) for w in sample.turns[0].answers)
    assert abs(final_prompt_tokens(tok, sample) - 32768) <= 0.05 * 32768


def test_fwe_counts(tok):
    for context in (1024, 4096):
        for sample in samples(tok, "fwe", context):
            (turn,) = sample.turns
            text = turn.user.split("coded words. ", 1)[1].split("\nQuestion:", 1)[0]
            counts = Counter(text.split())
            ranked = [w for w, _ in counts.most_common()]
            assert ranked[0] == "..." and tuple(ranked[1:4]) == turn.answers
            top = [counts[w] for w in ranked[:5]]
            assert top == sorted(set(top), reverse=True)  # strictly decreasing: the answer is unambiguous
            assert all(re.fullmatch(r"[a-z]{6}", w) for w in ranked[1:])


def test_fwe_minimum_has_distinct_ranks():
    counts = ruler.fwe_counts(ruler.FWE_MIN_WORDS, 10)
    assert counts[1] > counts[2] > counts[3] > counts[4] >= 1


def test_multiturn_positions_and_dependency(tok):
    for context in (1024, 4096):
        batch = samples(tok, "multiturn", context)
        for t in range(3):  # each turn sees every position across samples
            assert {s.meta["positions"][t] for s in batch} == set(POSITIONS)
        for s in batch:
            assert len(s.turns) == 3 and sorted(s.meta["positions"]) == sorted(POSITIONS)
            for turn, position in zip(s.turns, s.meta["positions"]):
                paragraphs = turn.user.split("\n\n")[1:]  # after the instructions
                at = [i for i, p in enumerate(paragraphs) if p.startswith("Question:")]
                assert at == [{"begin": 0, "middle": 1, "end": len(paragraphs) - 1}[position]]
                assert len(paragraphs) == (3 if position == "middle" else 2)
            first, second, last = s.turns
            dependent = last.answers[1]
            assert dependent in first.user and dependent not in second.user and dependent not in last.user
            if s.meta["dependency"] == "context":
                assert dependent not in first.answers  # only turn 1's context holds it
                assert "first text" in last.user
            else:
                assert first.answers == (dependent,)
                assert "your first answer" in last.user
        assert {s.meta["dependency"] for s in batch} == {"context", "reply"}


def test_multiturn_splits_the_context_evenly(tok):
    s = samples(tok, "multiturn", 4096)[0]
    lengths = [len(tok.encode(t.user)) for t in s.turns]
    assert max(lengths) < 1.15 * min(lengths)


# ---------------------------------------------------------------------------------------------
# Haystack details the generators rely on


def test_noise_and_depths():
    assert ruler.NOISE == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert len(ruler.DEPTHS) == 40 and ruler.DEPTHS[0] == 0 and ruler.DEPTHS[-1] == 100
    assert list(ruler.DEPTHS) == sorted(set(ruler.DEPTHS))
    assert ruler.NEEDLE.format(key="k", value="1") == "One of the special magic numbers for k is: 1."


def test_word_lists():
    w = ruler.words()
    assert len(w.nouns) >= 300 and len(w.adjectives) >= 150 and len(w.verbs) >= 100
    assert w.adverbs and w.prepositions
    vocabulary = w.vocabulary
    assert len(set(vocabulary)) == len(vocabulary)  # no word in two lists
    assert all(re.fullmatch(r"[a-z]+", word) for word in vocabulary)
    # Substring scoring cannot credit a cwe answer for a different word, nor a key for another key.
    for word in vocabulary:
        assert not any(word in other for other in vocabulary if other != word), word
    templates = " ".join(ruler.cwe_prompt("")).lower() + " " + ruler.NEEDLE.lower()
    assert not set(vocabulary) & set(re.findall(r"[a-z]+", templates))


def test_third_person():
    assert [ruler.third_person(v) for v in ("carry", "wash", "fix", "hold", "pass", "stay")] == [
        "carries", "washes", "fixes", "holds", "passes", "stays"
    ]


def test_prose_is_a_seeded_prefix_stream():
    a, b = ruler.Prose(7), ruler.Prose(7)
    first = a.take(5)
    assert a.take(50)[:5] == first and b.take(50) == a.take(50)
    assert ruler.Prose(8).take(50) != first
    for sentence in a.take(300):
        assert re.fullmatch(r"[A-Z][a-z ,]+\.", sentence), sentence  # no digits or hyphens: needles stand out
        assert not re.search(r"\b[Aa] [aeiou]", sentence), sentence


def test_insert_at_depths_keeps_order():
    out = ruler.insert_at_depths(["x"] * 4, ["a", "b", "c"], [0, 50, 50])
    assert out == ["a", "x", "x", "b", "c", "x", "x"]


# ---------------------------------------------------------------------------------------------
# Scoring


def test_postprocess():
    assert postprocess("  1234\x00567\t8 \n") == "1234\n567\n8"
    assert postprocess("\x01abc\x1f") == "abc"


@pytest.mark.parametrize(
    "pred,answers,metric,expected",
    [
        ("The number is 1234567.", ["1234567"], "all", 1.0),
        ("nothing here", ["1234567"], "all", 0.0),
        ("APPLE and Pear", ["apple", "pear"], "all", 1.0),  # case-insensitive
        ("apple, pear", ["apple", "pear", "plum", "fig"], "all", 0.5),  # partial credit: 2 of 4
        ("apple", ["apple", "pear", "plum"], "all", 1 / 3),
        ("only pear", ["apple", "pear"], "any", 1.0),
        ("neither", ["apple", "pear"], "any", 0.0),
        ("12\x0034567", ["1234567"], "all", 0.0),  # the control character splits the number
        ("  \tABCDE FGHIJ\n", ["abcde", "fghij"], "all", 1.0),
    ],
)
def test_score(pred, answers, metric, expected):
    assert score(pred, answers, metric) == pytest.approx(expected)


def test_score_rejects_bad_input():
    with pytest.raises(ValueError, match="metric"):
        score("x", ["x"], "some")
    with pytest.raises(ValueError):
        score("x", [], "all")


# ---------------------------------------------------------------------------------------------
# Custom JSONL tasks


def write(tmp_path: Path, lines: list[str], name: str = "tasks.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_custom_prompt_and_messages_forms(tmp_path):
    path = write(
        tmp_path,
        [
            json.dumps({"prompt": "Capital of France?", "answers": ["Paris"], "id": "q1"}),
            "",
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Remember 42."},
                        {"role": "assistant", "content": "OK."},
                        {"role": "user", "content": "Which number?"},
                    ],
                    "answers": ["42", "forty-two"],
                    "metric": "any",
                    "max_new_tokens": 8,
                }
            ),
        ],
        name="my_suite.jsonl",
    )
    first, second = load_jsonl(path)
    assert first.task == "my_suite" and first.index == 0 and first.history == ()
    assert first.turns[0].user == "Capital of France?" and first.turns[0].answers == ("Paris",)
    assert first.metric == "all" and first.max_new_tokens == 64 and first.meta == {"line": 1, "id": "q1"}
    assert second.index == 1 and second.meta == {"line": 3}
    assert [m["role"] for m in second.history] == ["system", "user", "assistant"]
    assert second.turns[0].user == "Which number?" and second.turns[0].answers == ("42", "forty-two")
    assert second.metric == "any" and second.max_new_tokens == 8
    assert second.segments == ()


def test_custom_segments_are_the_user_message_parts(tmp_path):
    line = {"prompt": "Which number?", "answers": ["42"],
            "segments": ["Notes:\n", {"text": "Remember 42.", "reuse": True, "namespace": "docs"}]}
    (s,) = load_jsonl(write(tmp_path, [json.dumps(line)]))
    assert s.segments == ({"text": "Notes:\n"}, {"text": "Remember 42.", "reuse": True, "namespace": "docs"},
                          {"text": "Which number?"})
    assert s.turns[0].user == "Notes:\nRemember 42.Which number?"


def test_custom_keeps_extra_keys(tmp_path):
    """A dataset's own fields are metadata, not errors."""
    (s,) = load_jsonl(write(tmp_path, [json.dumps({**OK, "kind": "qa", "category": {"a": 1}, "id": 7})]))
    assert s.meta == {"line": 1, "id": 7, "extra": {"kind": "qa", "category": {"a": 1}}}


def test_custom_through_build_samples(tmp_path, tok):
    path = write(tmp_path, [json.dumps({"prompt": f"p{i}", "answers": ["a"]}) for i in range(5)])
    got = build_samples(str(path), tok, 1024, 3, 0)  # not resized; every line: --samples is for generated tasks
    assert [s.turns[0].user for s in got] == ["p0", "p1", "p2", "p3", "p4"]
    got = build_samples(str(path), tok, 1024, 3, 0, limit=2)  # --limit caps
    assert [s.turns[0].user for s in got] == ["p0", "p1"]
    assert task_size(str(path), 3) == 5 and task_size("vt", 3) == 3


OK = {"prompt": "p", "answers": ["a"]}


@pytest.mark.parametrize(
    "line,expected",
    [
        ('{"prompt": "p", "answers": ["a"]', r"tasks\.jsonl:2: not valid JSON \("),
        (json.dumps({"prompt": "p"}), r'tasks\.jsonl:2: missing "answers"'),
        (json.dumps({"prompt": "p", "answers": "a"}), r'tasks\.jsonl:2: "answers" must be a non-empty list'),
        (json.dumps({"prompt": "p", "answers": []}), r'tasks\.jsonl:2: "answers" must be a non-empty list'),
        (json.dumps({"prompt": "p", "answers": [1]}), r'tasks\.jsonl:2: "answers" must be a non-empty list'),
        (json.dumps({**OK, "metric": "most"}), r'tasks\.jsonl:2: "metric" must be "all" or "any", not "most"'),
        (
            json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                        "answers": ["a"]}),
            r'tasks\.jsonl:2: "messages" must end with a user message',
        ),
        (
            json.dumps({"messages": [{"role": "bot", "content": "q"}], "answers": ["a"]}),
            r'tasks\.jsonl:2: "messages\[0\]\.role" must be one of system, user, assistant',
        ),
        (json.dumps({"answers": ["a"]}), r'tasks\.jsonl:2: missing "prompt" \(a string\) or "messages"'),
        (json.dumps({**OK, "messages": []}), r'tasks\.jsonl:2: give either "prompt" or "messages", not both'),
        (json.dumps({**OK, "max_new_tokens": 0}), r'tasks\.jsonl:2: "max_new_tokens" must be an integer of at least'),
        (json.dumps({**OK, "max_new_tokens": True}), r'tasks\.jsonl:2: "max_new_tokens" must be an integer'),
        (json.dumps({**OK, "segments": [{"text": 3}]}), r'tasks\.jsonl:2: "segments"\[0\]\.text: expected a non-empty string'),
        (json.dumps({**OK, "segments": [{"text": "t", "pinned": 1}]}), r'jsonl:2: "segments"\[0\]: unknown field'),
        (json.dumps({**OK, "segments": [{"text": "t", "reuse": "yes"}]}), r':2: "segments"\[0\]: "reuse" and "pin" must be true'),
        (json.dumps({"messages": [{"role": "user", "content": "q"}], "answers": ["a"], "segments": ["t"]}),
         r':2: "segments" go with "prompt"'),
        (json.dumps({**OK, "id": 1}), r'tasks\.jsonl:2: "id" 1 is also on line 1'),
        ("[1, 2]", r"tasks\.jsonl:2: expected a JSON object, got a list"),
    ],
)
def test_custom_errors_name_line_and_field(tmp_path, line, expected):
    path = write(tmp_path, [json.dumps({**OK, "id": 1}), line])
    with pytest.raises(SparsetuneError, match=expected) as e:
        load_jsonl(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_custom_empty_and_missing_files(tmp_path):
    with pytest.raises(SparsetuneError, match=r"empty\.jsonl: no tasks in the file"):
        load_jsonl(write(tmp_path, ["", "  "], name="empty.jsonl"))
    with pytest.raises(SparsetuneError, match=r"nowhere\.jsonl: no such file"):
        load_jsonl(tmp_path / "nowhere.jsonl")
