"""Tool calls without a server: the request's fields checked, the messages rendered for a
template that ignores tools, calls read out of text (whole or streamed in pieces, the same
either way), and the grammar that forces a call admitting exactly the allowed calls."""

from __future__ import annotations

import json
import random

import pytest

from specserve.runtime.constrained import GrammarSpec, create_backend
from specserve.runtime.entrypoints.protocol import parse_model
from specserve.runtime.entrypoints.request_bodies import ChatCompletionRequest
from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.tool_calls.formats import HermesFormat, SmolLM2Format, ToolCall, tool_format
from specserve.runtime.tool_calls.request import parse_tool_request, render_messages
from specserve.runtime.tool_calls.stream import ToolCallReader, read_all
from tests.helpers.tiny_models import EOS_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer_files

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
NAMES = {"get_weather", "get_time"}
SMOL = ('Sure. <tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n'
        '{"name": "get_time", "arguments": {"zone": "cet"}}\n]</tool_call>')
HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}\n'
          '</tool_call>')


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), [
    (SmolLM2Format(), SMOL, "Sure. ", [("get_weather", {"city": "Paris"}),
                                       ("get_time", {"zone": "cet"})]),
    (HermesFormat(), HERMES, None, [("get_weather", {"city": "Oslo"}),
                                    ("get_time", {"zone": "utc"})]),
    # an unknown function, broken JSON: no call, the text stays content
    (SmolLM2Format(), '<tool_call>[{"name": "nope", "arguments": {}}]</tool_call>',
     '<tool_call>[{"name": "nope", "arguments": {}}]</tool_call>', []),
    (HermesFormat(), '<tool_call>{"name": "get_time", </tool_call>',
     '<tool_call>{"name": "get_time", </tool_call>', []),
    # the model stopped right after the call: no end tag, complete JSON
    (HermesFormat(), '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}',
     None, [("get_time", {"zone": "cet"})]),
    (SmolLM2Format(), "no call here <tool_ca", "no call here <tool_ca", []),
])
def test_calls_are_read_out_of_the_text(fmt, text, content, calls):
    got_content, got = read_all(fmt, NAMES, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("seed", range(6))
def test_a_streamed_text_gives_the_whole_texts_calls_and_content(seed):
    rng = random.Random(seed)
    fmt = SmolLM2Format() if seed % 2 else HermesFormat()
    text = ("Let me check. " + SMOL if seed % 2 else HERMES) + " done<tool_c"
    reader, content, calls, end = ToolCallReader(fmt, NAMES), "", [], 0
    while end < len(text):
        end = min(len(text), end + rng.randrange(1, 9))
        new, got = reader.feed(text[:end])
        assert "<tool_c" not in new  # a possible tag is held back, never half sent
        content += new
        calls += got
    new, got = reader.finish(text)
    whole = read_all(fmt, NAMES, text)
    assert content + new == (whole[0] or "") and calls + got == whole[1]
    assert len(whole[1]) == 2


def test_tool_request_fields_are_checked():
    """Shapes are the HTTP types' (a 400 naming the path); `parse_tool_request` checks what
    they cannot say."""
    req = parse_tool_request([WEATHER, TIME], {"type": "function",
                                               "function": {"name": "get_time"}}, False)
    assert (req.choice, req.function, req.parallel, req.forced) == ("function", "get_time",
                                                                    False, True)
    assert parse_tool_request([WEATHER], None, None).choice == "auto"
    assert not parse_tool_request(None, None, None).offered
    assert not parse_tool_request([WEATHER], "none", None).offered
    for tools, choice, field in [
        ([WEATHER, WEATHER], None, "tools.1.function.name"),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], None,
         "tools.0.function.extra"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
         "tools.0.function.parameters"),
        ([{"type": "code"}], None, "tools.0.type"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}},
         "tool_choice.function.name"),
        ([WEATHER], {"type": "function", "function": {"name": {}}},
         "tool_choice.function.name"),
        ([WEATHER], "always", "tool_choice"),
        (None, "required", "tool_choice"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            body = parse_model(ChatCompletionRequest, {
                "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                "tool_choice": choice})
            parse_tool_request(body.tools_json(), body.tool_choice_json(), None)
        assert info.value.field == field


def test_messages_rendered_for_a_template_that_ignores_tools():
    fmt = tool_format("auto", template_renders_tools=False)
    assert isinstance(fmt, SmolLM2Format)
    req = parse_tool_request([WEATHER], "auto", None)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    out, tools = render_messages(messages, req, fmt, template_renders_tools=False)
    assert tools is None
    assert out[0]["content"].startswith("Be brief.\n\n") and "<tools>[" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                      "]</tool_call>"}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # the same conversation for a template that renders tools itself: as it came, with tools
    same, tools = render_messages(messages, req, HermesFormat(), template_renders_tools=True)
    assert same is messages and tools == [WEATHER]
    none = parse_tool_request([WEATHER], "none", None)
    plain, _ = render_messages(messages[:2], none, fmt, template_renders_tools=False)
    assert plain == messages[:2]  # tool_choice none: the tools are not shown


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    d = tmp_path_factory.mktemp("tool_tok")
    write_tiny_tokenizer_files(d)
    return create_backend("xgrammar", load_tokenizer(d), TINY_VOCAB_SIZE, [EOS_ID])


def accepts(backend, grammar: str, text: str) -> bool:
    m = backend.matcher(backend.compile(GrammarSpec("structural_tag", grammar)))
    ids = backend.tokenizer.encode(text, add_special_tokens=False)
    return all(m.accept(t) for t in ids) and m.accept(EOS_ID) and m.is_terminated()


@pytest.mark.parametrize("fmt", [SmolLM2Format(), HermesFormat()])
def test_the_forcing_grammar_admits_exactly_the_allowed_calls(backend, fmt):
    def text(*calls):
        return fmt.render_calls([{"name": n, "arguments": a} for n, a in calls])

    weather, clock = ("get_weather", {"city": "Rome"}), ("get_time", {"zone": "utc"})
    required = parse_tool_request([WEATHER, TIME], "required", None).forcing_grammar(fmt)
    assert accepts(backend, required, text(weather))
    assert accepts(backend, required, text(weather, clock))  # parallel calls
    assert not accepts(backend, required, text(("get_time", {"zone": "mars"})))  # its schema
    assert not accepts(backend, required, "I cannot call tools.")
    named = parse_tool_request([WEATHER, TIME], {"type": "function", "function": {
        "name": "get_time"}}, None).forcing_grammar(fmt)
    assert accepts(backend, named, text(clock))
    assert not accepts(backend, named, text(weather))
    assert not accepts(backend, named, text(clock, clock))  # a named call: one
    single = parse_tool_request([WEATHER], "required", False).forcing_grammar(fmt)
    assert not accepts(backend, single, text(weather, weather))
    assert read_all(fmt, NAMES, text(weather, clock))[1] == [
        ToolCall("get_weather", '{"city": "Rome"}'), ToolCall("get_time", '{"zone": "utc"}')]
