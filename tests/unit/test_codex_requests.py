"""What the Codex CLI sends to /v1/responses (`wire_api = "responses"`, `store: false`) and what it
reads back: its first request accepted as sent; namespaced tools offered and their calls named
as Codex looks tools up (own name plus the item's `namespace`); custom (freeform) tools served
as functions of one string; hosted tools left out and named; reasoning sealed for the next
request; a call that breaks a strict tool's schema kept as text, any other call returned as a
call. No model loaded."""
import json

import pydantic
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent

from scheduler import FinishReason
from server.api import responses as route
from server.chat.answer import Thinking
from server.http import errors
from server.http.errors import APIError
from server.openai import responses_body as body_api
from server.openai import responses_format as api
from server.openai import sealing
from server.service.generation import Collected, Final, Usage
from server.service.service import IGNORED_TOOLS_HEADER
from tests.grammar_bytes import accepts

EXEC = {"type": "function", "name": "exec_command", "strict": False,
        "description": "Runs a command in a PTY, returning output or a session ID.",
        "parameters": {"type": "object", "properties": {
            "cmd": {"type": "string", "description": "Shell command to execute."},
            "workdir": {"type": "string"}, "yield_time_ms": {"type": "number"}},
            "required": ["cmd"], "additionalProperties": False}}
PLAN = {"type": "function", "name": "update_plan", "strict": False, "description": "Updates the plan.",
        "parameters": {"type": "object", "properties": {"plan": {"type": "array", "items": {
            "type": "object", "properties": {"step": {"type": "string"},
                                             "status": {"type": "string",
                                                        "enum": ["pending", "in_progress", "completed"]}},
            "required": ["step", "status"], "additionalProperties": False}}},
            "required": ["plan"], "additionalProperties": False}}
LARK = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
APPLY_PATCH = {"type": "custom", "name": "apply_patch",
               "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, "
                              "so do not wrap the patch in JSON.",
               "format": {"type": "grammar", "syntax": "lark", "definition": LARK}}
AGENT_ARGS = {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"],
              "additionalProperties": False}
MULTI_AGENT = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agent tools.",
               "tools": [{"type": "function", "name": "spawn_agent", "strict": False,
                          "description": "Spawn a sub-agent.", "parameters": AGENT_ARGS},
                         {"type": "function", "name": "wait_agent", "strict": False,
                          "description": "Wait for sub-agents.",
                          "parameters": {"type": "object", "properties": {
                              "targets": {"type": "array", "items": {"type": "string"}}},
                              "additionalProperties": False}}]}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}


def codex_body(**kw) -> dict:
    """A first `codex exec` request, in the shape Codex's ResponsesApiRequest serializes."""
    return {
        "model": "m", "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions instructions>…"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context>…"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "List the files here."}]}],
        "tools": [EXEC, PLAN, APPLY_PATCH, MULTI_AGENT, WEB_SEARCH],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "low", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "019a-thread",
        "text": {"verbosity": "low"},
        "client_metadata": {"x-codex-installation-id": "00000000-0000"}, **kw}


def request(**kw) -> body_api.ResponsesRequest:
    return body_api.ResponsesRequest(**codex_body(**kw))


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def finished(body: body_api.ResponsesRequest, text: str, thinking: Thinking | None = None) -> list[dict]:
    return api.output_items(text, body_api.constraints(body, model=None).use, "msg_1", thinking,
                        body.seals_reasoning)


@pytest.fixture(autouse=True)
def server_key(tmp_path, monkeypatch):
    sealing.configure("test key", tmp_path)
    yield
    sealing.configure(None, None)


# ---- the first request ---------------------------------------------------------------------------
def test_a_codex_first_request_is_accepted_as_sent():
    body = request()
    body_api.reject_unsupported(body)
    asked = body_api.constraints(body, model=None)
    assert asked.grammar is None and asked.use.choice == "auto" and not asked.use.parallel
    assert [m["role"] for m in body_api.to_messages(body, asked.use)] == ["system", "system", "user", "user"]
    assert body.prompt_cache_key == "019a-thread"


def test_the_response_echoes_the_reasoning_and_verbosity_asked():
    body = request()
    state = api.ResponseState(body, "m", body_api.constraints(body, model=None).use)
    resp = state.response()
    assert resp["reasoning"] == {"effort": "low", "summary": "auto"}
    assert resp["text"]["verbosity"] == "low" and resp["store"] is False


# ---- namespaces ----------------------------------------------------------------------------------
def test_a_namespaces_functions_are_offered_each_under_its_own_name():
    use = body_api.constraints(request(), model=None).use
    assert [f.name for f in use.functions] == ["exec_command", "update_plan", "apply_patch",
                                               "spawn_agent", "wait_agent"]


def test_a_call_to_a_namespaced_function_comes_back_with_its_own_name_and_namespace():
    [item] = finished(request(), call("spawn_agent", {"message": "look at tests/"}))
    assert (item["type"], item["name"], item["namespace"]) == (
        "function_call", "spawn_agent", "multi_agent_v1")
    assert json.loads(item["arguments"]) == {"message": "look at tests/"}


def test_without_parallel_tool_calls_only_the_first_call_is_kept():
    items = finished(request(), call("exec_command", {"cmd": "ls"}) + "\n" + call("exec_command", {"cmd": "pwd"}))
    assert [json.loads(i["arguments"]) for i in items] == [{"cmd": "ls"}]


def test_a_call_to_a_top_level_function_has_no_namespace():
    [item] = finished(request(), call("exec_command", {"cmd": "ls"}))
    assert item["name"] == "exec_command" and "namespace" not in item


def test_tools_sharing_a_name_are_told_apart_by_their_namespace():
    other = {**MULTI_AGENT, "name": "mcp__shell__", "tools": [{**EXEC, "description": "MCP's."}]}
    use = body_api.constraints(request(tools=[EXEC, other]), model=None).use
    assert [f.name for f in use.functions] == ["exec_command", "mcp__shell__.exec_command"]
    [item] = finished(request(tools=[EXEC, other]), call("mcp__shell__.exec_command", {"cmd": "ls"}))
    assert (item["name"], item["namespace"]) == ("exec_command", "mcp__shell__")


def test_a_namespaced_call_in_the_history_is_shown_under_the_name_the_model_knows():
    other = {**MULTI_AGENT, "name": "mcp__shell__", "tools": [EXEC]}
    body = request(tools=[EXEC, other], input=[
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "namespace": "mcp__shell__",
         "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}])
    msgs = body_api.to_messages(body, body_api.constraints(body, model=None).use)
    assert msgs[2]["tool_calls"][0]["function"]["name"] == "mcp__shell__.exec_command"


def test_a_tool_choice_may_name_a_namespaced_function_by_its_own_name():
    use = body_api.constraints(request(tool_choice={"type": "function", "name": "wait_agent"}), None).use
    assert use.choice == "wait_agent"
    assert accepts(use.grammar(), call("wait_agent", {"targets": ["a"]}))


def test_a_namespace_without_a_tools_list_is_a_400_naming_it():
    with pytest.raises(APIError) as exc:
        body_api.constraints(request(tools=[{"type": "namespace", "name": "x", "description": ""}]), None)
    assert exc.value.param == "tools[0].tools"


# ---- custom (freeform) tools ---------------------------------------------------------------------
def test_a_custom_tool_is_offered_as_a_function_of_one_string_with_its_grammar_described():
    [patch] = [f for f in body_api.constraints(request(), None).use.functions if f.name == "apply_patch"]
    assert patch.parameters["properties"] == {"input": {"type": "string"}}
    assert LARK in patch.description and "FREEFORM" in patch.description


def test_a_custom_tool_call_comes_back_as_a_custom_tool_call_item_with_its_input():
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    [item] = finished(request(), call("apply_patch", {"input": patch}))
    assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "apply_patch", patch)
    assert item["id"].startswith("ctc_") and item["call_id"].startswith("call_")


def test_a_custom_tool_call_without_its_input_string_stays_text():
    [item] = finished(request(), call("apply_patch", {"patch": "x"}))
    assert item["type"] == "message" and "apply_patch" in item["content"][0]["text"]


def test_a_custom_tool_call_and_its_output_in_the_history_become_a_call_and_a_tool_message():
    body = request(input=[{"type": "message", "role": "user", "content": "edit"},
                          {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch",
                           "input": "*** Begin Patch\n*** End Patch"},
                          {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"}])
    msgs = body_api.to_messages(body, body_api.constraints(body, None).use)
    fn = msgs[2]["tool_calls"][0]["function"]
    assert fn["name"] == "apply_patch" and json.loads(fn["arguments"]) == {
        "input": "*** Begin Patch\n*** End Patch"}
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}


def test_a_tool_choice_naming_a_custom_tool_forces_its_call():
    use = body_api.constraints(request(tool_choice={"type": "custom", "name": "apply_patch"}), None).use
    assert accepts(use.grammar(), call("apply_patch", {"input": "x"}))


# ---- hosted tools --------------------------------------------------------------------------------
def test_hosted_tools_are_left_out_of_the_prompt_and_named_once():
    hosted = [WEB_SEARCH, {"type": "image_generation", "output_format": "png"},
              {"type": "web_search", "search_context_size": "low"}, {"type": "local_shell"},
              {"type": "tool_search", "execution": "client", "description": "", "parameters": {}}]
    asked = body_api.constraints(request(tools=[EXEC, *hosted]), None)
    assert [f.name for f in asked.use.functions] == ["exec_command"]
    assert asked.ignored_tools == ["web_search", "image_generation", "local_shell", "tool_search"]


def test_only_hosted_tools_leave_no_tool_offered():
    use = body_api.constraints(request(tools=[WEB_SEARCH]), None).use
    assert not use.active and use.choice == "none"


@pytest.mark.parametrize("kind", ["web search", "x\r\nSet-Cookie: a=b", "", 3, "é"])
def test_a_tool_type_that_could_not_be_named_in_a_header_is_a_400(kind):
    with pytest.raises(APIError) as exc:
        body_api.constraints(request(tools=[EXEC, {"type": kind}]), None)
    assert exc.value.param == "tools[1].type"


@pytest.mark.parametrize("choice", [{"type": "web_search"}, {"type": "web_search_preview"},
                                    {"type": "file_search"}, {"type": "image_generation"},
                                    {"type": "mcp", "server_label": "x"}])
def test_a_tool_choice_forcing_a_hosted_tool_is_a_400(choice):
    with pytest.raises(APIError) as exc:
        body_api.constraints(request(tool_choice=choice), None)
    assert (exc.value.status, exc.value.param, exc.value.code) == (
        400, "tool_choice", "unsupported_parameter")


# ---- reasoning, sealed ---------------------------------------------------------------------------
def test_a_reasoning_item_carries_its_text_sealed_when_include_asks():
    rs, msg = finished(request(), "The user wants a listing.</think>Here.", Thinking.OPEN)
    assert rs["type"] == "reasoning" and msg["type"] == "message"
    assert sealing.unseal(rs["encrypted_content"]) == "The user wants a listing."


def test_without_include_a_reasoning_item_has_no_encrypted_content():
    rs, _ = finished(request(include=[]), "Plan.</think>Here.", Thinking.OPEN)
    assert "encrypted_content" not in rs


def test_a_sealed_reasoning_item_sent_back_is_the_reasoning_of_its_turn():
    rs, msg = finished(request(), "Plan: run ls.</think>Listing.", Thinking.OPEN)
    # what Codex sends back: no id, no reasoning_text content, the sealed text
    again = {"type": "reasoning", "summary": [], "encrypted_content": rs["encrypted_content"]}
    body = request(input=[{"type": "message", "role": "user", "content": "ls"}, again,
                          {"type": "message", "role": "assistant", "content": [
                              {"type": "output_text", "text": "Listing."}]},
                          {"type": "message", "role": "user", "content": "thanks"}])
    assert body_api.to_messages(body)[2] == {"role": "assistant", "content": "Listing.",
                                    "reasoning_content": "Plan: run ls."}


def test_a_reasoning_item_with_a_null_encrypted_content_uses_its_summary():
    body = request(input=[{"type": "reasoning", "encrypted_content": None,
                           "summary": [{"type": "summary_text", "text": "sum"}]}])
    assert body_api.to_messages(body)[1]["reasoning_content"] == "sum"


@pytest.mark.parametrize("token", ["tampered", sealing.base64.urlsafe_b64encode(b"\x01" * 60).decode()])
def test_an_encrypted_content_this_server_did_not_seal_is_a_400_naming_it(token):
    body = request(input=[{"type": "message", "role": "user", "content": "hi"},
                          {"type": "reasoning", "summary": [], "encrypted_content": token}])
    with pytest.raises(APIError) as exc:
        body_api.to_messages(body)
    assert (exc.value.status, exc.value.param) == (400, "input[1].encrypted_content")


def test_a_streamed_reasoning_item_is_sealed_once_and_sent_as_it_ends():
    body = request()
    state = api.ResponseState(body, "m", body_api.constraints(body, None).use, USAGE, thinking=Thinking.OPEN)
    events = [*state.pieces_events("Plan"), *state.pieces_events(".</think>Done."),
              *state.end_events()]
    done = [_parse(e) for e in events if b"response.output_item.done" in e][0]
    assert sealing.unseal(done.item.encrypted_content) == "Plan."
    assert state.output[0]["encrypted_content"] == done.item.encrypted_content


# ---- tool schemas the grammar cannot hold whole --------------------------------------------------
ENV = {"type": "function", "name": "set_env", "description": "Set environment variables.",
       "parameters": {"type": "object", "properties": {"env": {
           "type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
           "additionalProperties": {"type": "string"}}}, "required": ["env"]}}


@pytest.mark.parametrize("strict", [False, None])
def test_a_tool_that_is_not_strict_may_use_keywords_the_grammar_cannot_enforce(strict):
    tool = {**ENV, "strict": strict} if strict is not None else ENV
    [fn] = body_api.constraints(request(tools=[tool]), None).use.functions
    assert "propertyNames" not in json.dumps(fn.enforced)
    assert fn.parameters == ENV["parameters"]   # the model sees the whole schema


def test_a_strict_tool_whose_schema_cannot_be_enforced_is_a_400_naming_its_parameters():
    with pytest.raises(APIError) as exc:
        body_api.constraints(request(tools=[{**ENV, "strict": True}]), None)
    assert exc.value.param == "tools[0].parameters" and "propertyNames" in exc.value.message


def test_a_forced_call_is_held_to_what_the_grammar_can_enforce():
    use = body_api.constraints(request(tools=[ENV], tool_choice="required"), None).use
    assert accepts(use.grammar(), call("set_env", {"env": {"PATH": "/bin"}}))
    assert not accepts(use.grammar(), call("set_env", {"env": {"PATH": 1}}))


def test_a_call_that_breaks_the_schema_of_a_tool_that_is_not_strict_is_a_call_as_written():
    """As OpenAI returns one: only `strict: true` promises the schema; the client checks the
    arguments of any other call (and tells the model)."""
    body = request(tools=[ENV])
    arguments = {"env": {"path": "/bin"}}          # breaks propertyNames
    [message, item] = finished(body, "Setting. " + call("set_env", arguments))
    assert message["content"][0]["text"] == "Setting."
    assert (item["type"], item["name"]) == ("function_call", "set_env")
    assert json.loads(item["arguments"]) == arguments


def test_a_call_that_breaks_a_strict_tools_schema_stays_text_as_written():
    body = request(tools=[{**EXEC, "strict": True}])
    [item] = finished(body, "Running. " + call("exec_command", {"command": "ls"}))
    assert item["type"] == "message"
    assert item["content"][0]["text"] == 'Running.<tool_call>{"name": "exec_command", ' \
                                         '"arguments": {"command": "ls"}}</tool_call>'
    [ok] = finished(body, call("exec_command", {"cmd": "ls"}))
    assert ok["type"] == "function_call"


@pytest.mark.parametrize("strict", [False, True])
def test_a_streamed_call_that_breaks_its_schema_is_a_call_unless_the_tool_is_strict(strict):
    body = request(tools=[{**EXEC, "strict": strict}])
    state = api.ResponseState(body, "m", body_api.constraints(body, None).use, USAGE)
    events = [*state.pieces_events(call("exec_command", {"command": "ls"})), *state.end_events()]
    kinds = [_parse(e).type for e in events]
    assert ("response.function_call_arguments.done" in kinds) is not strict
    assert [i["type"] for i in state.output] == ["message" if strict else "function_call"]


# ---- streamed calls, as the OpenAI SDK parses them -----------------------------------------------
USAGE = Usage(prompt_tokens=3, completion_tokens=5, cached_tokens=0)   # the request's


def _parse(message: bytes):
    data = message.decode().split("\n", 2)[1]
    return pydantic.TypeAdapter(ResponseStreamEvent).validate_json(data[len("data: "):])


def test_streamed_custom_and_namespaced_calls_are_events_the_sdk_parses():
    body = request(parallel_tool_calls=True)
    state = api.ResponseState(body, "m", body_api.constraints(body, None).use, USAGE)
    text = call("apply_patch", {"input": "*** Begin Patch\n*** End Patch"}) + "\n" + \
        call("spawn_agent", {"message": "go"})
    events = [_parse(e) for e in [*state.pieces_events(text), *state.end_events()]]
    assert [e.type for e in events] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert events[2].input == "*** Begin Patch\n*** End Patch"
    assert events[7].item.namespace == "multi_agent_v1" and events[7].item.name == "spawn_agent"
    state.finish = FinishReason.STOP
    final = Response.model_validate({**state.response(), "usage": None})
    assert [o.type for o in final.output] == ["custom_tool_call", "function_call"]


# ---- the route: the header, the session key ------------------------------------------------------
class _Generation:
    """A request answering one canned text."""
    def __init__(self, text):
        self.text = text

    async def stream(self):
        yield Final(self.text, finish_reason=FinishReason.STOP, usage=USAGE)

    async def collect(self):
        return [Collected(self.text, FinishReason.STOP, [], usage=USAGE)]


class _Service:
    """What the route asks of the service, answering one canned text."""
    def __init__(self, text):
        self.text, self.submitted = text, {}

    async def get(self, model, http, keep_alive):
        lm = type("LM", (), {})()
        lm.model, lm.name = None, model
        lm.template = type("T", (), {"thinks": False})()
        return lm

    async def chat_prompt(self, lm, messages, max_tokens, http, use=None):
        return type("P", (), {"opens_thinking": False})()

    def generate(self, lm, request, client):
        self.submitted = {"affinity": request.affinity, "grammar": request.grammar,
                          "blame": request.blame.prompt}
        return _Generation(self.text)


def _client(text: str) -> tuple[TestClient, _Service]:
    app = FastAPI()
    errors.install(app)
    app.include_router(route.router)
    app.state.service = svc = _Service(text)
    return TestClient(app), svc


@pytest.mark.parametrize("stream", [False, True])
def test_the_route_names_ignored_tools_in_a_header_and_keeps_the_session_key(stream):
    client, svc = _client(call("exec_command", {"cmd": "ls"}))
    resp = client.post("/v1/responses", json=codex_body(stream=stream))
    assert resp.status_code == 200 and resp.headers[IGNORED_TOOLS_HEADER] == "web_search"
    assert svc.submitted["affinity"] == "019a-thread"
    assert '"exec_command"' in resp.text


def test_the_route_sends_no_header_when_no_tool_was_left_out():
    client, _ = _client("Hello.")
    resp = client.post("/v1/responses", json=codex_body(stream=False, tools=[EXEC]))
    assert resp.status_code == 200 and IGNORED_TOOLS_HEADER not in resp.headers
    assert resp.json()["output"][0]["content"][0]["text"] == "Hello."


def test_the_route_answers_a_forced_hosted_tool_with_a_400():
    client, _ = _client("")
    resp = client.post("/v1/responses", json=codex_body(tool_choice={"type": "web_search"}))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
