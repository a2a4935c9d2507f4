"""The tokenizer process's side of reuse inside SGLang (0.5.16 and 0.5.23, CPU; issue #44): SGLang's real
request objects (`ChatCompletionRequest`, `GenerateReqInput`) and `HookRegistry`, the embedded model's
tokenizer as SGLang's tokenizer manager holds it.

- A chat request with parts: its ids are the parts inside the tokenizer's chat frame (the engine's
  encoding), its custom_params carry the layout in the parts' place; a chat of several messages, or
  of content parts, is refused in one line (HTTP 400: a ValueError).
- /generate (and /v1/completions) with parts: the text encoded part by part; each distinct segment
  is sent first as a request of its own under its namespace's segment key (one token, its ids
  alone), before SGLang's own generate_request (and its model-update lock), and the request goes on
  after those; refused: a layout a client sent itself, token ids with parts, parts that are not the
  text, a batch, input logprobs, parallel samples, a LoRA adapter, an extra_key, and a plain
  request's key in the segment store's namespace; a plain batch's shared sampling params untouched.
- The hooks' targets resolve in both versions through SGLang's own registry.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.managers.io_struct import GenerateReqInput

from sparsetune.export.sglang import segments
from sparsetune.export.sglang.segments import FIELD, LAYOUT, layout_spans
from sparsetune.export.sglang.store import segment_key
from sparsetune.models.resolve import resolve_model
from sparsetune.models.tokenizer import HFTokenizer
from sparsetune.reuse.parts import encode_parts, parse_parts

DOC, NOTE = "The vault code is 4417.\n", "Bring a torch.\n"
PARTS = ["Read: ", {"text": DOC, "reuse": True, "namespace": "kb"}, {"text": NOTE, "reuse": True},
         {"text": DOC, "reuse": True, "namespace": "kb"}, "What is the code?"]
TEXT = "Read: " + DOC + NOTE + DOC + "What is the code?"


@pytest.fixture(scope="module")
def hf():
    return resolve_model("smollm2-135m").load_tokenizer().hf


class Manager:
    """What the hooks use of SGLang's TokenizerManager: its tokenizer and `generate_request`, recorded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.sent = tokenizer, []

    async def generate_request(self, obj, request=None):
        self.sent.append(obj)
        yield {"text": "x"}


def test_a_chat_request_with_parts_is_encoded_in_the_chat_frame(hf):
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": TEXT}],
                                    custom_params={FIELD: json.dumps(PARTS), "other": 1})

    def convert(serving, req):  # SGLang's conversion: the template's ids, custom_params carried over
        return GenerateReqInput(input_ids=hf.apply_chat_template([{"role": "user", "content": TEXT}], tokenize=True),
                                sampling_params={"custom_params": dict(req.custom_params or {})}), req

    serving = type("Serving", (), {"tokenizer_manager": Manager(hf)})()
    adapted, _ = segments.chat_request(convert, serving, request)
    want = encode_parts(HFTokenizer.wrap(hf), parse_parts(PARTS), chat=True)
    assert adapted.input_ids == want.token_ids and adapted.text is None
    params = adapted.sampling_params["custom_params"]
    assert FIELD not in params and params["other"] == 1
    assert layout_spans(params, len(want.token_ids)) == want.spans
    # then SGLang's generate_request: encoded already (not twice), the segments sent first
    manager = serving.tokenizer_manager
    ran = []

    async def original(m, o, *a):
        ran.append(list(o.input_ids))
        yield "reply"

    asyncio.run(drain(segments.generate_request(original, manager, adapted)))
    assert ran == [want.token_ids] and len(manager.sent) == 2
    for kw, needle in (({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXT}]},
                         "one user message"),
                        ({"messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]}, "one user message of text"),
                        ({"messages": [{"role": "user", "content": TEXT}], "chat_template_kwargs": {"enable_thinking": False}},
                         "no tools and no chat_template_kwargs")):
        bad = ChatCompletionRequest(model="m", custom_params={FIELD: json.dumps(PARTS)}, **kw)
        with pytest.raises(ValueError, match=needle):
            segments.chat_request(convert, serving, bad)
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": TEXT}])
    assert segments.chat_request(convert, serving, plain)[0].sampling_params["custom_params"] == {}


async def drain(gen) -> list:
    return [out async for out in gen]


def test_segments_stored_before_are_filled_beside_the_request_not_before_it(hf):
    """The engine fills a segment before the request that reuses it; so does the hook the first time.
    A segment this process has had stored is filled without waiting (SGLang's tree has it; an evicted
    one is computed as prompt text and stored again by that fill)."""
    segments._STORED.clear()
    manager = Manager(hf)
    seen = []

    async def original(m, o, *a):
        seen.append(len(m.sent))
        yield "reply"

    def request():
        return GenerateReqInput(text=TEXT, sampling_params={"max_new_tokens": 8, "custom_params": {FIELD: json.dumps(PARTS)}})

    async def three():
        await drain(segments.generate_request(original, manager, request()))  # both segments new: awaited
        await drain(segments.generate_request(original, manager, request()))  # both stored: sent beside it
        for _ in range(4):
            await asyncio.sleep(0)
        other = [PARTS[0], {**PARTS[1], "namespace": "kb2"}, *PARTS[2:]]
        obj = GenerateReqInput(text=TEXT, sampling_params={"custom_params": {FIELD: json.dumps(other)}})
        await drain(segments.generate_request(original, manager, obj))  # a new namespace: its segment awaited

    asyncio.run(three())
    # the second request went on before its fills were sent; the third waited for its new segment's only
    assert seen == [2, 2, 7] and len(manager.sent) == 7 and not segments._PENDING
    keys = [f.extra_key for f in manager.sent]
    assert set(keys[2:4]) == {segment_key("kb"), segment_key("default")}
    assert sorted(keys[4:]) == sorted([segment_key("kb"), segment_key("default"), segment_key("kb2")])
    assert len(segments._STORED) == 3


def test_a_generate_request_with_parts_stores_its_segments_first(hf):
    segments._STORED.clear()
    manager = Manager(hf)
    obj = GenerateReqInput(text=TEXT, sampling_params={"max_new_tokens": 8, "custom_params": {FIELD: json.dumps(PARTS)}})
    seen = []

    async def original(m, o, *a):  # SGLang's generate_request: it takes its model-update lock in here
        seen.append((None if o.input_ids is None else list(o.input_ids), len(m.sent)))
        yield "reply"

    assert asyncio.run(drain(segments.generate_request(original, manager, obj))) == ["reply"]
    want = encode_parts(HFTokenizer.wrap(hf), parse_parts(PARTS), chat=False)
    assert seen == [(want.token_ids, 2)]  # after both distinct segments were sent, before the lock
    fills = {(tuple(f.input_ids), f.extra_key, f.sampling_params["max_new_tokens"]) for f in manager.sent}
    assert fills == {(tuple(hf.encode(DOC, add_special_tokens=False)), segment_key("kb"), 1),
                     (tuple(hf.encode(NOTE, add_special_tokens=False)), segment_key("default"), 1)}
    params = obj.sampling_params["custom_params"]
    assert FIELD not in params and layout_spans(params, len(want.token_ids)) == want.spans
    parts = {FIELD: json.dumps(PARTS)}
    for kw, needle in (({"text": TEXT, "sampling_params": {"custom_params": {LAYOUT: "[]"}}}, "written by the server"),
                       ({"input_ids": [1, 2, 3], "sampling_params": {"custom_params": parts}}, "send the prompt as text"),
                       ({"text": TEXT + "!", "sampling_params": {"custom_params": parts}}, "they differ at character"),
                       ({"text": [TEXT, TEXT], "sampling_params": {"custom_params": parts}}, "not a batch"),
                       ({"text": TEXT, "sampling_params": {"custom_params": parts}, "return_logprob": True,
                         "logprob_start_len": 0}, "input logprobs"),
                       ({"text": TEXT, "sampling_params": {"custom_params": parts, "n": 2}}, "parallel samples"),
                       ({"text": TEXT, "sampling_params": {"custom_params": parts}, "lora_path": "a"}, "a LoRA adapter"),
                       ({"text": TEXT, "sampling_params": {"custom_params": parts}, "extra_key": "x"}, "an extra_key"),
                       ({"text": TEXT, "extra_key": segment_key("kb")}, "sparsetune's segment store")):
        bad = GenerateReqInput(**kw)
        with pytest.raises(ValueError, match=needle):
            asyncio.run(drain(segments.generate_request(original, Manager(hf), bad)))
    plain = GenerateReqInput(text=TEXT, sampling_params={"max_new_tokens": 8})
    quiet = Manager(hf)
    asyncio.run(drain(segments.generate_request(original, quiet, plain)))
    assert quiet.sent == [] and plain.input_ids is None
    # a batch of plain prompts shares one sampling-params dict: untouched; /v1/completions writes
    # custom_params None into it; a server without a tokenizer (--skip-tokenizer-init) serves plain ones
    shared = {"max_new_tokens": 4, "custom_params": None}
    batch = GenerateReqInput(text=[TEXT, TEXT], sampling_params=shared)
    asyncio.run(drain(segments.generate_request(original, Manager(hf), batch)))
    assert shared == {"max_new_tokens": 4, "custom_params": None}
    single = GenerateReqInput(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "custom_params": None})
    assert asyncio.run(drain(segments.generate_request(original, Manager(None), single))) == ["reply"]


def test_the_tokenizer_hooks_resolve_on_sglangs_targets():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in segments.HOOKS:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    for cls, name in ((OpenAIServingChat, "_convert_to_internal_request"), (TokenizerManager, "generate_request")):
        assert getattr(getattr(cls, name), "__wrapped__", None) is not None, name
