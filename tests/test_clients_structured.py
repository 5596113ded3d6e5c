"""langchain-openai's with_structured_output against the real server, in its three methods.
(instructor is not here: no release of it accepts the pinned openai 3.54.)"""
import pytest
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")


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
