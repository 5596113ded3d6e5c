"""Structured output through client libraries against the real server:
- langchain-openai's with_structured_output, in its three methods;
- instructor 1.17.0 (installed with --no-deps, see requirements-instructor.txt) from_openai in
  Mode.JSON_SCHEMA (response_format json_schema), Mode.TOOLS (a tool named in tool_choice) and
  create_partial streaming in Mode.JSON_SCHEMA (its jiter partial parsing). Both send a schema
  the server turns into a grammar, so the answer must validate; max_retries=0, so instructor
  cannot hide a bad answer behind a reask.
(instructor's Mode.JSON sends json_object with the schema only in the prompt: nothing makes a
small model follow it, so it is not tested here.)"""
import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")
instructor = pytest.importorskip("instructor")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int


def llm(server_url, model_name):
    return langchain_openai.ChatOpenAI(base_url=f"{server_url}/v1", api_key="unused",
                                       model=model_name, temperature=0, max_tokens=64,
                                       max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_a_valid_object(server_url, model_name, method):
    out = llm(server_url, model_name).with_structured_output(Person, method=method).invoke(
        "Invent a person.")
    assert isinstance(out, Person)


def test_with_structured_output_json_mode_returns_a_dict(server_url, model_name):
    schema = Person.model_json_schema()
    out = llm(server_url, model_name).with_structured_output(schema, method="json_mode").invoke(
        'Repeat exactly: {"name": "Ann", "age": 30}')
    assert isinstance(out, dict)


PROMPT = [{"role": "user", "content": "Invent a person."}]


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_extracts_a_valid_object(client, model_name, mode):
    ic = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    out, raw = ic.chat.completions.create_with_completion(
        model=model_name, messages=PROMPT, response_model=Person, max_retries=0,
        temperature=0, max_tokens=64)
    assert isinstance(out, Person)
    assert isinstance(out.name, str) and len(out.name) <= 20 and isinstance(out.age, int)
    choice = raw.choices[0]
    if mode == "TOOLS":
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == ["Person"]
    else:
        assert choice.finish_reason == "stop" and not choice.message.tool_calls


def test_instructor_partial_streaming(client, model_name):
    ic = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    parts = list(ic.chat.completions.create_partial(
        model=model_name, messages=PROMPT, response_model=Person, max_retries=0,
        temperature=0, max_tokens=64))
    assert len(parts) > 1                       # one per streamed chunk, not one at the end
    assert parts[0].age is None                 # the first chunks cannot hold the whole object
    assert isinstance(Person.model_validate(parts[-1].model_dump()), Person)
