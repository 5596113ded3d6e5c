"""`think` on Ollama's routes, through the `ollama` Python client: the reasoning comes apart from
the answer as `message.thinking` (`thinking` on /api/generate), streamed before the content,
`think: false` answers without it, and /api/show lists the `thinking` capability.

No reasoning GGUF is at hand offline, so, as in tests/test_reasoning.py, SmolLM2 is served with
the test template tests/templates/thinking-chatml.jinja: its generation prompt opens `<think>`,
as DeepSeek-R1 distills' templates do, and two example turns show the model how to close it.
What is tested is the route's handling of a template that reasons, not a reasoning model."""
import ollama
import pytest

from tests.server_proc import ROOT, SMOLLM2, running_server

THINKER = "thinker"
TEMPLATE = ROOT / "tests" / "templates" / "thinking-chatml.jinja"
Q = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 40}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    models = tmp_path_factory.mktemp("ollama-thinker") / "models.yaml"
    models.write_text(f"models:\n  - name: {THINKER}\n    path: {SMOLLM2}\n"
                      f"    chat_template: {TEMPLATE}\n")
    with running_server({"PAGEDLLAMA_MODELS_FILE": str(models), "PAGEDLLAMA_N_CTX": "1024",
                         "PAGEDLLAMA_MAX_SEQS": "2"}) as base:
        yield ollama.Client(host=base, timeout=120)


def test_the_reasoning_comes_apart_as_thinking(client):
    asked = client.chat(model=THINKER, messages=Q, options=GREEDY, think=True)
    assert asked.message.thinking == "The capital of France is Paris."
    assert asked.message.content == "Paris" and asked.done_reason == "stop"
    left_out = client.chat(model=THINKER, messages=Q, options=GREEDY)   # as the template does
    assert (left_out.message.thinking, left_out.message.content) == ("The capital of France "
                                                                     "is Paris.", "Paris")
    assert "thinking" in client.show(THINKER).capabilities


def test_the_thinking_streams_before_the_content(client):
    whole = client.chat(model=THINKER, messages=Q, options=GREEDY, think=True)
    lines = list(client.chat(model=THINKER, messages=Q, options=GREEDY, think=True,
                             stream=True))
    kinds = ["thinking" if line.message.thinking else "content" if line.message.content
             else "none" for line in lines]
    assert kinds.count("thinking") > 2 and kinds.index("content") > kinds.index("thinking")
    assert "thinking" not in kinds[kinds.index("content"):]
    assert "".join(line.message.thinking or "" for line in lines) == whole.message.thinking
    assert "".join(line.message.content for line in lines) == whole.message.content


def test_generate_returns_the_thinking_too(client):
    answer = client.generate(model=THINKER, prompt=Q[0]["content"], options=GREEDY, think=True)
    assert (answer.thinking, answer.response) == ("The capital of France is Paris.", "Paris")


def test_think_false_answers_without_reasoning(client):
    """The prompt's reasoning block is closed empty: the model answers at once (SmolLM2, which
    never saw an empty block in the template's examples, answers poorly, but without one)."""
    plain = client.chat(model=THINKER, messages=Q, options=GREEDY, think=False)
    assert plain.message.thinking is None
    assert "<think>" not in plain.message.content and "</think>" not in plain.message.content
    assert plain.message.content


def test_a_reasoning_level_is_a_400(client):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=THINKER, messages=Q, options=GREEDY, think="high")
    assert err.value.status_code == 400 and "reasoning levels" in err.value.error
