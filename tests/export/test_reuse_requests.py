"""How a request to SGLang marks reusable segments (issue #44; `export.sglang.segments`): the engine's
parts as a JSON string in `custom_params`, encoded as the engine encodes them (a segment has the same
ids at any position; a chat request's ids are the chat template around the parts), and every
malformed request one line that SGLang answers with HTTP 400 (a ValueError)."""

from __future__ import annotations

import json

import pytest

from sparsetune.export.sglang.segments import FIELD, LAYOUT, encode_request, layout_param, layout_spans, request_parts
from sparsetune.models.resolve import resolve_model
from sparsetune.models.tokenizer import HFTokenizer
from sparsetune.reuse.parts import encode_parts, parse_parts


@pytest.fixture(scope="module")
def tok():
    """The embedded model's tokenizer as SGLang's tokenizer process holds it (transformers'), wrapped."""
    return HFTokenizer.wrap(resolve_model("smollm2-135m").load_tokenizer().hf)


DOC = "The vault code is 4417. Keep it safe.\n"
PARTS = ["Read this. ", {"text": DOC, "reuse": True, "namespace": "kb"}, "What is the vault code?"]


def params(parts):
    return {FIELD: json.dumps(parts)}


def test_a_marked_request_is_encoded_as_the_engine_encodes_it(tok):
    parts = request_parts(params(PARTS))
    prompt = "".join(p.text for p in parts)
    layout = encode_request(tok, parts, prompt, chat=True)
    assert layout.token_ids == encode_parts(tok, parse_parts(PARTS), chat=True).token_ids  # the engine's encoding
    # the chat template around the prompt: the same text a server without the plugin would read
    templated = tok.hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    assert tok.hf.decode(layout.token_ids) == templated
    # the segment's ids are its own tokenization, wherever it sits
    (seg,) = layout.segments
    assert layout.token_ids[seg.start:seg.end] == tok.encode(DOC) and seg.namespace == "kb"
    moved = encode_request(tok, request_parts(params(["Q first? ", PARTS[1]])), "Q first? " + DOC, chat=False)
    (seg2,) = moved.segments
    assert seg2.start != seg.start and moved.token_ids[seg2.start:seg2.end] == tok.encode(DOC)
    # the scheduler reads back the layout the tokenizer process wrote, every span
    assert layout_spans({LAYOUT: layout_param(layout)}, len(layout.token_ids)) == layout.spans
    assert request_parts({"other": 1}) is None and layout_spans({}, 10) is None


@pytest.mark.parametrize("custom_params, prompt, needle", [
    ({FIELD: PARTS}, None, "must be a JSON string (json.dumps of the parts list), not list"),
    ({FIELD: "[{\"text\": "}, None, "is not JSON (Expecting value at character 10)"),
    ({FIELD: "[]"}, None, "expected a non-empty list of parts"),
    ({FIELD: json.dumps([{"text": "a", "reuse": True, "colour": 1}])}, None, "unknown field(s) ['colour']"),
    ({FIELD: json.dumps([{"text": "a", "reuse": "yes"}])}, None, "\"reuse\" and \"pin\" must be true or false"),
    ({FIELD: json.dumps(PARTS), LAYOUT: "[[0,1,\"kb\",false]]"}, None, "is written by the server"),
    ({FIELD: json.dumps(PARTS)}, "Read this! " + DOC + "What is the vault code?", "they differ at character 9"),
    ({FIELD: json.dumps(["just text"])}, "just text", "no part has \"reuse\": true"),
])
def test_a_badly_marked_request_is_one_line_for_http_400(tok, custom_params, prompt, needle):
    with pytest.raises(ValueError) as e:
        parts = request_parts(custom_params)
        encode_request(tok, parts, prompt, chat=True)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_malformed_layout_is_refused():
    ok = '[[0,4,false,"default",false],[4,20,true,"kb",false]]'
    assert [s.reuse for s in layout_spans({LAYOUT: ok}, 20)] == [False, True]
    for raw in ("nope", "[[0]]", '[[3,1,true,"kb",false]]', '[[0,4,true,"kb",false],[2,20,true,"kb",false]]',
                '[[0,99,true,"kb",false]]', '[[0,4,true,"kb",false],[5,20,true,"kb",false]]', '[[0,4,true,"kb",false]]',
                '[[1,20,true,"kb",false]]'):
        with pytest.raises(ValueError, match="sparsetune_layout"):
            layout_spans({LAYOUT: raw}, 20)
