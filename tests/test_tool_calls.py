"""Tool-call parsers on recorded answers in the Hermes (Qwen2 / Qwen2.5) and Llama 3 JSON formats."""

from __future__ import annotations

import json

import pytest

from mmkv.server.tool_calls import parse_hermes, parse_llama3_json, parser_for_template


def calls(parsed):
    content, found = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in found]


def test_hermes_calls_with_text_around_them_and_several_calls():
    one = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    assert calls(parse_hermes(one)) == ("Let me look.", [("get_weather", {"city": "Oslo", "days": 2})])
    two = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>')
    assert calls(parse_hermes(two)) == (None, [("a", {}), ("b", {"x": [1, 2]})])
    cut = '<tool_call>\n{"name": "a", "arguments": {"q": "é"}}'  # stopped before the closing tag
    assert calls(parse_hermes(cut)) == (None, [("a", {"q": "é"})])
    ids = [c.id for c in parse_hermes(two)[1]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>oops</tool_call>',  # one bad of two
])
def test_what_is_not_a_well_formed_hermes_call_comes_back_as_content(text):
    assert parse_hermes(text) == (text, [])


def test_llama3_json_calls():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert calls(parse_llama3_json(one)) == (None, [("get_weather", {"city": "Oslo"})])
    tagged = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": "{\\"b\\": 2}"}'
    assert calls(parse_llama3_json(tagged)) == (None, [("f", {"a": 1}), ("g", {"b": 2})])
    lines = '{"name": "f", "parameters": {}}\n{"name": "g", "parameters": {}}'
    assert [name for name, _ in calls(parse_llama3_json(lines))[1]] == ["f", "g"]


@pytest.mark.parametrize("text", [
    "The weather in Oslo is mild.",
    '{"name": "f", "parameters": {"a": 1}',  # malformed JSON
    '{"city": "Oslo"}',  # no name
    '{"name": "f", "parameters": {}} and then some prose',
])
def test_what_is_not_a_well_formed_llama3_call_comes_back_as_content(text):
    assert parse_llama3_json(text) == (text, [])


def test_the_parser_follows_the_template():
    assert parser_for_template("{% for tool in tools %}<tools>...</tools><tool_call>{% endfor %}") == "hermes"
    assert parser_for_template('<|python_tag|>{"name": ..., "parameters": ...}') == "llama3_json"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None
