"""How a request to SGLang marks reusable segments (issue #44): the engine's parts, carried in `custom_params`.

A client sends the prompt as the engine takes it (`reuse.parts`): a list of parts, each plain text
or `{"text": ..., "reuse": true, "namespace": "kb1", "pin": false}`, as one JSON string under
`"sparsetune_parts"` in the request's `custom_params`. SGLang carries `custom_params` to the
scheduler from `/generate`'s `sampling_params` and from the OpenAI routes' top-level field (an
OpenAI client's `extra_body`); its values are typed scalars on the way (msgpack), so the list
travels as text. The parts' texts, concatenated, must be the prompt itself: a completion's prompt,
`/generate`'s `text`, or a chat request's one user message. A server without the plugin then
answers the same request from the same text.

The tokenizer process encodes such a prompt as the engine does (`encode_parts`: each part on its
own, a chat request's inside the chat template's frame), so a segment has the same token ids
wherever it appears and is found by its ids, and hands the scheduler the layout's spans under
`"sparsetune_layout"` (JSON: `[[start, end, reuse, namespace, pin], ...]`, every span, in order). A bad
request raises `ValueError` with one line naming the problem and the fix: SGLang answers it with
HTTP 400 (`TokenizerManager` and the OpenAI routes turn a ValueError into one).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

from sparsetune.errors import SparsetuneError
from sparsetune.reuse.parts import Part, ReuseLayout, Span, encode_parts, parse_parts

logger = logging.getLogger(__name__)

FIELD = "sparsetune_parts"  # what a client sets in custom_params
LAYOUT = "sparsetune_layout"  # what the tokenizer process adds for the scheduler


def request_parts(custom_params: dict[str, Any] | None) -> list[Part] | None:
    """The parts a request's `custom_params` marks (None: a plain request); ValueError (HTTP 400) if
    they are malformed. A client may not set the layout itself: the tokenizer process writes it."""
    params = custom_params or {}
    if LAYOUT in params:
        raise ValueError(f"custom_params.{LAYOUT} is written by the server; send the prompt's parts as "
                         f"custom_params.{FIELD} instead")
    raw = params.get(FIELD)
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ValueError(f"custom_params.{FIELD} must be a JSON string (json.dumps of the parts list), not "
                         f"{type(raw).__name__}: SGLang's custom_params hold scalars only")
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"custom_params.{FIELD} is not JSON ({e.msg} at character {e.pos})") from None
    try:
        return parse_parts(obj, f"custom_params.{FIELD}")
    except SparsetuneError as e:
        raise ValueError(str(e)) from None


def encode_request(tokenizer, parts: list[Part], prompt: str, *, chat: bool) -> ReuseLayout:
    """The token ids and spans of a request's prompt, each part tokenized on its own (in the chat
    frame for a chat request): the engine's encoding (`encode_parts`). `tokenizer`: sparsetune's
    (`models.tokenizer.HFTokenizer.wrap(SGLang's)`). ValueError if the parts are not the prompt."""
    joined = "".join(p.text for p in parts)
    if joined != prompt:
        at = next((i for i, (a, b) in enumerate(zip(joined, prompt)) if a != b), min(len(joined), len(prompt)))
        what = "the chat request's user message" if chat else "the prompt"
        raise ValueError(f"custom_params.{FIELD}: the parts' texts, joined, must be {what} exactly; they differ at "
                         f"character {at} (parts: {len(joined)} characters, {what}: {len(prompt)})")
    if not any(p.reuse for p in parts):
        raise ValueError(f"custom_params.{FIELD}: no part has \"reuse\": true; mark the segments to reuse, or drop the field")
    try:
        return encode_parts(tokenizer, parts, chat=chat)
    except SparsetuneError as e:
        raise ValueError(str(e)) from None


def layout_param(layout: ReuseLayout) -> str:
    """A layout's spans, as the scheduler reads them from custom_params (`LAYOUT`)."""
    return json.dumps([[s.start, s.end, s.reuse, s.namespace, s.pin] for s in layout.spans], separators=(",", ":"))


def layout_spans(custom_params: dict[str, Any] | None, num_tokens: int) -> list[Span] | None:
    """The spans the tokenizer process wrote for a prompt of `num_tokens` ids (None: a plain request),
    one after another from 0 to the end. They come from this package's own hook; a malformed value
    is refused."""
    raw = (custom_params or {}).get(LAYOUT)
    if raw is None:
        return None
    try:
        spans = [Span(int(a), int(b), bool(reuse), str(ns), bool(pin)) for a, b, reuse, ns, pin in json.loads(raw)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"custom_params.{LAYOUT} is malformed ({e}); it is the server's own field") from None
    last = 0
    for s in spans:
        if not (last == s.start < s.end <= num_tokens):
            raise ValueError(f"custom_params.{LAYOUT}: span [{s.start}, {s.end}) does not follow on at {last} in a prompt "
                             f"of {num_tokens} tokens; it is the server's own field")
        last = s.end
    if last != num_tokens:
        raise ValueError(f"custom_params.{LAYOUT}: the spans end at {last}, the prompt at {num_tokens}; it is the "
                         "server's own field")
    return spans


# ---- the tokenizer process's hooks (SGLang's HookRegistry: an AROUND hook gets the original first) ----
#
# - `OpenAIServingChat._convert_to_internal_request` (`chat_request`): a chat request with parts holds
#   one user message of text, which the parts make up (no tools, no template arguments: the frame is
#   the tokenizer's own chat template, as the engine's); its ids are the parts inside that frame, and
#   its custom_params carry the layout in the parts' place.
# - `TokenizerManager.generate_request` (`generate_request`: every route, before SGLang takes its
#   model-update lock): a prompt with parts is encoded likewise (text only, no frame), a request that
#   cannot be served so is refused (a layout a client sent itself, a batch, input logprobs, hidden
#   states, parallel samples, a LoRA adapter, a cache salt or key of its own, multimodal data), and,
#   as the engine queues a segment's fill before the request that needs it, each distinct segment is
#   sent first as a request of its own (`store_segments`: its ids alone, under the segment key of its
#   namespace, one token), which SGLang keeps in its tree at positions 0.. (a stored one is a prefix
#   hit there: one token computed, nothing stored again). The request waits for the fills of segments
#   this process has not had stored before; the others' fills go beside it (on an H200, with every fill
#   awaited, 92-105 ms passed before a 32K request's admission, against 2-3 ms for a plain one:
#   BENCHMARKS.md, "Reuse bundles inside SGLang").

_ENCODED = "_sparsetune_encoded"  # on a GenerateReqInput this module encoded (a chat request's)
_FILL = "_sparsetune_fill"  # on a segment's own request


def _custom_params(obj) -> dict[str, Any] | None:
    sp = getattr(obj, "sampling_params", None)
    return sp.get("custom_params") if isinstance(sp, dict) else None


def _with_layout(obj, params: dict[str, Any], layout: ReuseLayout) -> None:
    obj.input_ids = layout.token_ids
    custom = {**{k: v for k, v in params.items() if k != FIELD}, LAYOUT: layout_param(layout)}
    obj.sampling_params = {**obj.sampling_params, "custom_params": custom}  # a copy: a batch shares one dict
    setattr(obj, _ENCODED, True)


def chat_request(original, serving, request, *args, **kwargs):
    adapted, request = original(serving, request, *args, **kwargs)
    params = _custom_params(adapted)
    parts = request_parts(params)
    if parts is None:
        return adapted, request
    messages = request.messages
    if len(messages) != 1 or messages[0].role != "user" or not isinstance(messages[0].content, str):
        raise ValueError(f"custom_params.{FIELD}: a chat request with parts holds one user message of text, which the "
                         "parts make up (put a conversation's earlier turns in the parts)")
    if getattr(request, "tools", None) or getattr(request, "chat_template_kwargs", None):
        raise ValueError(f"custom_params.{FIELD}: a chat request with parts takes no tools and no chat_template_kwargs "
                         "(its frame is the tokenizer's own chat template, as on sparsetune's engine)")
    from sparsetune.models.tokenizer import HFTokenizer

    layout = encode_request(HFTokenizer.wrap(serving.tokenizer_manager.tokenizer), parts, messages[0].content, chat=True)
    adapted.text = None
    _with_layout(adapted, params, layout)
    return adapted, request


_REFUSED = (("return_hidden_states", "hidden states"), ("lora_path", "a LoRA adapter"), ("lora_id", "a LoRA adapter"),
            ("cache_salt", "a cache salt"), ("extra_key", "an extra_key"), ("image_data", "images"),
            ("video_data", "videos"), ("audio_data", "audio"), ("input_embeds", "input embeddings"))


def check_request(obj, tokenizer) -> ReuseLayout | None:
    """What `generate_request` does before SGLang sees a request: a plain one passes (unless it takes a
    segment key of its own); one with parts is encoded (a chat request's already was) and returned
    as its layout; one that cannot be served so is a ValueError (HTTP 400). `tokenizer()`: sparsetune's
    tokenizer over SGLang's (`models.tokenizer.HFTokenizer.wrap`), asked for only to encode parts (a
    server launched with --skip-tokenizer-init has none)."""
    from sparsetune.export.sglang.store import KEY_PREFIX

    own = [k for k in ("extra_key", "cache_salt") if isinstance(getattr(obj, k, None), str) and getattr(obj, k).startswith(KEY_PREFIX)]
    if own and not getattr(obj, _FILL, False):
        raise ValueError(f"{own[0]}: keys starting {KEY_PREFIX!r} are sparsetune's segment store; mark segments with "
                         f"custom_params.{FIELD} instead")
    sp = getattr(obj, "sampling_params", None)
    if isinstance(sp, list) or isinstance(getattr(obj, "text", None), list) or _is_batch_ids(obj):
        custom = [(p or {}).get("custom_params") for p in (sp if isinstance(sp, list) else [sp]) if isinstance(p, dict)]
        if any(isinstance(c, dict) and (FIELD in c or LAYOUT in c) for c in custom):
            raise ValueError(f"custom_params.{FIELD}: one prompt per request with parts, not a batch")
        return None
    params = _custom_params(obj)
    if not isinstance(params, dict) or (FIELD not in params and LAYOUT not in params):
        return None
    if not getattr(obj, _ENCODED, False):
        parts = request_parts(params)  # refuses a layout a client sent
        if not isinstance(obj.text, str) or obj.input_ids is not None:
            raise ValueError(f"custom_params.{FIELD}: send the prompt as text (the parts' texts joined), not token ids")
        _with_layout(obj, params, encode_request(tokenizer(), parts, obj.text, chat=False))
    bad = [what for k, what in _REFUSED if getattr(obj, k, None)]
    start = getattr(obj, "logprob_start_len", None)
    if getattr(obj, "return_logprob", False) and start is not None and start >= 0:
        bad.append("input logprobs (logprob_start_len)")
    if (obj.sampling_params or {}).get("n", 1) not in (None, 1):
        bad.append("parallel samples (n)")
    if bad:
        raise ValueError(f"custom_params.{FIELD}: a request with parts is served without {', '.join(dict.fromkeys(bad))}; "
                         "drop them")
    return ReuseLayout(list(obj.input_ids), layout_spans(obj.sampling_params["custom_params"], len(obj.input_ids)))


def _is_batch_ids(obj) -> bool:
    ids = getattr(obj, "input_ids", None)
    return isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


async def generate_request(original, manager, obj, *args, **kwargs):
    from sglang.srt.managers.io_struct import GenerateReqInput

    if isinstance(obj, GenerateReqInput):
        from sparsetune.models.tokenizer import HFTokenizer

        layout = check_request(obj, lambda: HFTokenizer.wrap(manager.tokenizer))
        if layout is not None:
            await store_segments(manager, layout)
    async for out in original(manager, obj, *args, **kwargs):
        yield out


# Segments this process has had stored, by (namespace, hash of the token ids): their fills are sent
# without waiting. Oldest first; bounded, so a long-running server forgets the least recent. (A hash
# collision only lets a request go on without its fill: the segment, if not stored, is prompt text.)
_STORED: OrderedDict[tuple[str, int], None] = OrderedDict()
STORED_MAX = 65536
_PENDING: set = set()  # fills in flight that nobody awaits (kept referenced until they end)


async def store_segments(manager, layout: ReuseLayout) -> None:
    """Each distinct segment of a prompt as a request of its own, under its namespace's segment key.
    One this process has not had stored yet is awaited, as the engine fills a segment before the
    request that reuses it. One it has (`_STORED`) is sent without waiting: the request goes on at
    once and finds it in SGLang's tree; were it evicted since, the request computes it as prompt text
    and its fill stores it again for the next."""
    import asyncio

    from sglang.srt.managers.io_struct import GenerateReqInput

    from sparsetune.export.sglang.store import segment_key

    async def one(key: tuple[str, int], seg: tuple[int, ...]) -> None:
        fill = GenerateReqInput(input_ids=list(seg), sampling_params={"max_new_tokens": 1}, extra_key=segment_key(key[0]))
        setattr(fill, _FILL, True)
        async for _ in manager.generate_request(fill):
            pass
        _STORED[key] = None
        _STORED.move_to_end(key)
        while len(_STORED) > STORED_MAX:
            _STORED.popitem(last=False)

    wanted = {}  # (namespace, hash of the ids) -> the ids, each distinct segment once
    for span in layout.segments:
        seg = tuple(layout.token_ids[span.start : span.end])
        wanted[(span.namespace, hash(seg))] = seg
    new = [key for key in wanted if key not in _STORED]
    for key in wanted.keys() - set(new):
        task = asyncio.ensure_future(one(key, wanted[key]))
        _PENDING.add(task)
        task.add_done_callback(_fill_done)
    await asyncio.gather(*(one(key, wanted[key]) for key in new))


def _fill_done(task) -> None:
    _PENDING.discard(task)
    if not task.cancelled() and task.exception() is not None:
        logger.warning("sparsetune: a stored segment's fill failed (%s); requests compute it as prompt text",
                       task.exception())


HOOKS: list[tuple[str, Any, str]] = [
    ("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request", chat_request, "AROUND"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request", generate_request, "AROUND"),
]


def add_hooks(hooks) -> None:
    """Register (target, hook, kind) triples with SGLang's hook registry, each once per process (what
    `load_plugins` then applies; a caller after it applies them itself)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in hooks:
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, getattr(HookType, kind))
