"""Tool calling through ``mmkv serve`` with the ``openai`` client, on a tiny random Llama whose chat
template is Hermes-style (Qwen2.5's format: tools in the system turn, calls in ``<tool_call>``
tags, results as ``<tool_response>``).

A random model never chooses a call itself, so each test forces what it says: ``tool_choice``
(named, required) through structured output, or for ``auto`` a regex (vLLM's ``guided_regex``)
that makes the model write a call in the template's format, which the Hermes parser must read.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from mmkv import Engine
from server_harness import MODEL_NAME, start_server

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"enum": ["oslo", "rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "weather in oslo?"}]


def with_template(source, path, template: str):
    """The tiny Llama with ``template``, and room for a prompt that lists tools one character a
    token (RoPE positions: the longer context needs no other weight)."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tools_model(model_dirs, tmp_path_factory):
    return with_template(model_dirs["llama"], tmp_path_factory.mktemp("tools") / "llama", HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def served(tools_model):
    running = start_server(Engine(tools_model, device="cpu", debug=True))
    yield running
    running.stop()
    running.engine.check_integrity()


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def check_calls(message, names: set[str]) -> None:
    assert message.tool_calls and message.content is None
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called_with_valid_arguments(served):
    answer = client(served).chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message, {"get_weather"})
    assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate_against_their_functions(served, parallel):
    answer = client(served).chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
        max_tokens=300, temperature=1.0, seed=5, n=3)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message, {"get_weather", "get_time"})
        if not parallel:
            assert len(choice.message.tool_calls) == 1


HERMES_CALL = r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(oslo|rome)", "days": [1-9]\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_own_format_streamed_or_not(served, stream):
    """The model made to write a Hermes call after some text: the call comes back parsed, the
    text as content, the finish reason ``tool_calls``; streamed, as ``delta.tool_calls``."""
    api = client(served)
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
                  extra_body={"guided_regex": HERMES_CALL})
    if not stream:
        choice = api.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    else:
        chunks = list(api.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content = "".join(d.content or "" for d in deltas) or None
        calls = [call for d in deltas for call in d.tool_calls or ()]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert content == "Sure." and finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


def test_an_answer_that_does_not_parse_comes_back_as_content(served):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": oops}\n</tool_call>'
    choice = client(served).chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
        extra_body={"guided_regex": broken.replace("{", r"\{").replace("}", r"\}")}).choices[0]
    assert choice.message.content == broken and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_a_call_and_its_result_render_into_the_next_turn(served):
    """The assistant's call and the ``role: tool`` result render with the template, and the
    exchange is answered."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "oslo", "days": 2})}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain, 12 degrees"}]
    ids = served.engine.render_chat(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {**call["function"], "arguments": {"city": "oslo", "days": 2}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "rain, 12 degrees"}], tools=TOOLS)
    text = served.engine.tokenizer.decode(ids)
    assert '<tool_response>\nrain, 12 degrees\n</tool_response>' in text
    assert '{"name": "get_weather", "arguments": {"city": "oslo", "days": 2}}' in text and "get_time" in text
    answer = client(served).chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS,
                                                    max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names 'nope', which is not among the tools (get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "a forced tool call (tool_choice) is structured output already"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}]},
     "messages.1.tool_calls: arguments must be a JSON object as text"),
])
def test_a_bad_tools_field_is_a_400_naming_it(served, body, message):
    import httpx

    r = httpx.post(f"{served.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": ASK, **body})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_a_template_that_cannot_render_tools_is_a_400(model_dirs, tmp_path):
    path = with_template(model_dirs["llama"], tmp_path / "llama",
                         "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    running = start_server(Engine(path, device="cpu"))
    try:
        api = client(running)
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            api.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=2,
                                        tool_choice="required")
        with pytest.raises(openai.BadRequestError, match="need a tool-call parser"):
            api.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=2)
    finally:
        running.stop()


def test_run_batch_answers_tools_and_echo_as_the_server_does(tools_model):
    """A batch file's chat line with a named tool and completion line with ``echo`` get the
    server's answers: a parsed call, and the prompt with its logprobs."""
    from mmkv.server.batch_file import run_batch

    lines = [{"custom_id": "call", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 200,
                       "tool_choice": {"type": "function", "function": {"name": "get_time"}}}},
             {"custom_id": "echo", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL_NAME, "prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1}}]
    call, echo = [r["response"]["body"]["choices"][0]
                  for r in run_batch(Engine(tools_model, device="cpu"), [json.dumps(line) for line in lines],
                                     progress=False)]
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
    [made] = call["message"]["tool_calls"]
    assert made["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(made["function"]["arguments"]), TIME)
    assert echo["text"] == "abc" and echo["logprobs"]["tokens"] == ["a", "b", "c"]
    assert echo["logprobs"]["token_logprobs"][0] is None and len(echo["logprobs"]["token_logprobs"]) == 3
