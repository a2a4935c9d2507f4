"""The tokenizer process's side of reuse inside SGLang (0.5.16 and 0.5.23, CPU; issue #44): SGLang's real
request objects (`ChatCompletionRequest`, `GenerateReqInput`) and `HookRegistry`, the embedded model's
tokenizer as SGLang's tokenizer manager holds it.

- A chat request with parts: its ids are the parts inside the tokenizer's chat frame (the engine's
  encoding), its custom_params carry the layout in the parts' place; a chat of several messages, or
  of content parts, is refused in one line (HTTP 400: a ValueError).
- /generate (and /v1/completions) with parts: the text encoded part by part; each distinct segment
  is sent first as a request of its own under its namespace's segment key (one token, its ids
  alone), and the request goes on after those; a layout a client sent itself, token ids with parts,
  parts that are not the text: refused.
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
    assert [(s.start, s.end) for s in layout_spans(params, len(want.token_ids))] == [(s.start, s.end) for s in want.segments]
    for messages, needle in (([{"role": "system", "content": "be brief"}, {"role": "user", "content": TEXT}], "one user message"),
                             ([{"role": "user", "content": [{"type": "text", "text": TEXT}]}], "one user message of text")):
        bad = ChatCompletionRequest(model="m", messages=messages, custom_params={FIELD: json.dumps(PARTS)})
        with pytest.raises(ValueError, match=needle):
            segments.chat_request(convert, serving, bad)
    plain = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": TEXT}])
    assert segments.chat_request(convert, serving, plain)[0].sampling_params["custom_params"] == {}


def run(coro):
    return asyncio.run(coro)


def test_a_generate_request_with_parts_stores_its_segments_first(hf):
    manager = Manager(hf)
    obj = GenerateReqInput(text=TEXT, sampling_params={"max_new_tokens": 8, "custom_params": {FIELD: json.dumps(PARTS)}})
    obj.normalize_batch_and_arguments()
    seen = []

    async def original(m, o):
        seen.append((None if o.input_ids is None else list(o.input_ids), len(m.sent)))
        return "tokenized"

    assert run(segments.tokenize_request(original, manager, obj)) == "tokenized"
    want = encode_parts(HFTokenizer.wrap(hf), parse_parts(PARTS), chat=False)
    assert seen == [(want.token_ids, 2)]  # after both distinct segments were sent
    fills = {(tuple(f.input_ids), f.extra_key, f.sampling_params["max_new_tokens"]) for f in manager.sent}
    assert fills == {(tuple(hf.encode(DOC, add_special_tokens=False)), segment_key("kb"), 1),
                     (tuple(hf.encode(NOTE, add_special_tokens=False)), segment_key("default"), 1)}
    assert LAYOUT in obj.sampling_params["custom_params"] and FIELD not in obj.sampling_params["custom_params"]
    for kw, needle in (({"text": TEXT, "custom_params": {LAYOUT: "[]"}}, "written by the server"),
                       ({"input_ids": [1, 2, 3], "custom_params": {FIELD: json.dumps(PARTS)}}, "send the prompt as text"),
                       ({"text": TEXT + "!", "custom_params": {FIELD: json.dumps(PARTS)}}, "they differ at character")):
        bad = GenerateReqInput(**{k: v for k, v in kw.items() if k != "custom_params"},
                               sampling_params={"custom_params": kw["custom_params"]})
        bad.normalize_batch_and_arguments()
        with pytest.raises(ValueError, match=needle):
            run(segments.tokenize_request(original, Manager(hf), bad))
    plain = GenerateReqInput(text=TEXT, sampling_params={"max_new_tokens": 8})
    plain.normalize_batch_and_arguments()
    quiet = Manager(hf)
    run(segments.tokenize_request(original, quiet, plain))
    assert quiet.sent == [] and plain.input_ids is None


def test_the_tokenizer_hooks_resolve_on_sglangs_targets():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in segments.HOOKS:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    HookRegistry.apply_hooks()
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    for cls, name in ((OpenAIServingChat, "_convert_to_internal_request"), (TokenizerManager, "_tokenize_one_request")):
        assert getattr(getattr(cls, name), "__wrapped__", None) is not None, name
