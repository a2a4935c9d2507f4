"""Custom tasks: a JSONL file of prompts (or chat conversations) with their answers.

One JSON object per line (blank lines skipped):

    {"prompt": "...", "answers": ["..."]}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
     "answers": ["...", "..."], "metric": "any", "max_new_tokens": 16, "id": "q7",
     "segments": [{"text": "...", "reuse": true, "namespace": "docs"}]}

`prompt` or `messages` (ending with the user message the model answers; the ones before it are
the sample's history), `answers` (non-empty list of strings), and optionally `metric` ("all":
fraction of answers found, the default; "any": 1 if any is found), `max_new_tokens`, `id`, and
`segments`: the parts of the user message before `prompt` (strings, or {"text", "reuse",
"namespace", "pin"} objects, see `reuse/parts.py`); with `--reuse` the reusable ones come from the
segment cache. Any other key (a dataset's `kind`, `category`, ids) is kept as the sample's
metadata (`meta.extra` in samples.jsonl). The task's name is the file's stem. Custom samples are
used as written: `--context` does not resize them; every line runs unless `--limit` caps them.

Every mistake is a `SparsetuneError` naming the file, the line and the field, so a user can fix a
large file from the message alone.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from sparsetune.errors import SparsetuneError
from sparsetune.evaluation.samples import METRICS, Sample, Turn
from sparsetune.reuse.parts import parse_parts

KEYS = ("prompt", "messages", "answers", "metric", "max_new_tokens", "id", "segments")
ROLES = ("system", "user", "assistant")
DEFAULT_MAX_NEW_TOKENS = 64


class _LineError(Exception):
    """A problem with one line; `load_jsonl` adds the file and line number."""


# Parsed files by (path, content hash): one eval checks, sizes and builds a file's tasks from one parse.
_PARSED: dict[tuple[str, str], tuple[Sample, ...]] = {}
_PARSED_MAX = 8


def load_jsonl(path: str | Path) -> list[Sample]:
    """The samples of a custom task file, validated line by line (parsed once per content)."""
    path = Path(path)
    if not path.is_file():
        raise SparsetuneError(
            f"{path}: no such file; pass an existing .jsonl file or a built-in task (sparsetune eval --list-tasks)"
        )
    data = path.read_bytes()
    key = (str(path), hashlib.sha256(data).hexdigest())
    if key not in _PARSED:
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[key] = tuple(_parse(path, data))
    return list(_PARSED[key])


def _parse(path: Path, data: bytes) -> list[Sample]:
    try:
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # newlines as read_text reads them
    except UnicodeDecodeError as e:
        raise SparsetuneError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    samples: list[Sample] = []
    ids: dict[Any, int] = {}
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other characters splitlines breaks on.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            samples.append(_sample(line, path.stem, len(samples), lineno, ids))
        except _LineError as e:
            raise SparsetuneError(f"{path}:{lineno}: {e}") from None
    if not samples:
        raise SparsetuneError(f"{path}: no tasks in the file; write one JSON object per line")
    return samples


def _sample(line: str, task: str, index: int, lineno: int, ids: dict[Any, int]) -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _LineError(f"not valid JSON ({e.msg} at column {e.colno}); write one JSON object per line") from None
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {_kind(obj)}; write one JSON object per line")
    answers = _answers(obj)
    metric = obj.get("metric", "all")
    if metric not in METRICS:
        raise _LineError(f'"metric" must be "all" or "any", not {json.dumps(metric)}')
    max_new_tokens = obj.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise _LineError(f'"max_new_tokens" must be an integer of at least 1, not {json.dumps(max_new_tokens)}')
    sample_id = obj.get("id")
    if sample_id is not None:
        if not (isinstance(sample_id, str) or _is_int(sample_id)):
            raise _LineError(f'"id" must be a string or an integer, not {_kind(sample_id)}')
        if sample_id in ids:
            raise _LineError(f'"id" {json.dumps(sample_id)} is also on line {ids[sample_id]}; ids must be unique')
        ids[sample_id] = lineno

    history, user = _conversation(obj)
    segments = _segments(obj, user, history)
    if segments:
        user = "".join(p["text"] for p in segments)
    meta: dict[str, Any] = {"line": lineno}
    if sample_id is not None:
        meta["id"] = sample_id
    extra = {k: v for k, v in obj.items() if k not in KEYS}
    if extra:  # a dataset's own fields (kind, category, ids): kept in samples.jsonl, not used
        meta["extra"] = extra
    return Sample(
        task=task,
        index=index,
        turns=(Turn(user, answers),),
        metric=metric,
        max_new_tokens=max_new_tokens,
        history=history,
        segments=segments,
        meta=meta,
    )


def _answers(obj: dict[str, Any]) -> tuple[str, ...]:
    if "answers" not in obj:
        raise _LineError('missing "answers": give a non-empty list of the strings a correct reply contains')
    answers = obj["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise _LineError('"answers" must be a non-empty list of non-empty strings, e.g. ["Paris"]')
    return tuple(answers)


def _conversation(obj: dict[str, Any]) -> tuple[tuple[dict[str, str], ...], str]:
    """(history, user message) from `prompt` or `messages`."""
    if "prompt" in obj and "messages" in obj:
        raise _LineError('give either "prompt" or "messages", not both')
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise _LineError('"prompt" must be a non-empty string')
        return (), prompt
    if "messages" not in obj:
        raise _LineError('missing "prompt" (a string) or "messages" (a list of {"role", "content"} objects)')
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise _LineError('"messages" must be a non-empty list of {"role", "content"} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise _LineError(f'"messages[{i}]" must be an object with exactly "role" and "content"')
        if m["role"] not in ROLES:
            raise _LineError(f'"messages[{i}].role" must be one of {", ".join(ROLES)}, not {json.dumps(m["role"])}')
        if not isinstance(m["content"], str):
            raise _LineError(f'"messages[{i}].content" must be a string')
    if messages[-1]["role"] != "user":
        raise _LineError(
            f'"messages" must end with a user message (the one the model answers); the last is {messages[-1]["role"]}'
        )
    return tuple(dict(m) for m in messages[:-1]), messages[-1]["content"]


def _segments(obj: dict[str, Any], prompt: str, history: tuple) -> tuple[dict[str, Any], ...]:
    """The user message as parts: the `segments` (plain or reusable text) followed by `prompt`."""
    if "segments" not in obj:
        return ()
    if history or "messages" in obj:
        raise _LineError('"segments" go with "prompt" (the question after them), not with "messages"')
    try:
        parse_parts(obj["segments"], where='"segments"')  # validation only; the parts stay as written
    except SparsetuneError as e:
        raise _LineError(str(e)) from None
    return tuple({"text": p} if isinstance(p, str) else dict(p) for p in obj["segments"]) + ({"text": prompt},)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}[
        type(value)
    ]
