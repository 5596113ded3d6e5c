"""Workloads: random prompts, shared-prefix prompts, multi-turn chat conversations.

Prompts are text made of random words from a fixed vocabulary (portable: any server tokenizes
them). Their length in tokens is calibrated against the server itself: two probe requests
(`max_tokens=1`) of known word counts give the tokens per word and the fixed overhead (chat
template, BOS) from `usage.prompt_tokens`; a server that reports no usage falls back to
TOKENS_PER_WORD, measured with SmolLM2's tokenizer on this vocabulary.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

# Common English words; almost all are one token with a leading space in BPE vocabularies.
VOCABULARY = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education foot boy age policy
music market sense nation plan college interest death experience effect use class control
care field development role effort rate heart drug show leader light voice wife police mind
price report decision son view relationship town road arm difference value building action
model season society tax director position player record paper space ground form event
official matter center couple site project activity star table need court oil situation cost
industry figure street image phone data picture practice piece land product doctor wall
patient worker news test movie north love support technology step baby computer type
attention film tree source organization hair window evidence population truth song
bring begin keep hold write stand hear meet include continue learn change lead understand
watch follow stop create speak read allow spend grow open walk win offer remember consider
appear buy wait serve die send expect build stay fall cut reach kill remain suggest raise pass
sell require report decide pull good new first last long great little own other old right big
high different small large next early young important few public bad same able
""".split()
VOCABULARY = list(dict.fromkeys(VOCABULARY))   # unique, in a fixed order

TOKENS_PER_WORD = 1.0   # SmolLM2's tokenizer: every word here is one token (fallback only)

QUESTION_WORDS = ["what", "why", "how", "where", "when", "which", "who"]


@dataclass
class Calibration:
    """prompt tokens ≈ overhead + tokens_per_word × words, for one endpoint of one server."""
    tokens_per_word: float = TOKENS_PER_WORD
    overhead: float = 0.0
    method: str = "approx"

    def words_for(self, tokens: int, with_overhead: bool = True) -> int:
        body = tokens - (self.overhead if with_overhead else 0.0)
        return max(1, round(body / self.tokens_per_word))


@dataclass
class Conversation:
    """One conversation: an optional system prompt (the shared prefix) and the user turns.
    A single-turn conversation with plain=True is sent to /v1/completions as the bare text."""
    user_turns: list[str | list[int]]
    system: str | None = None
    plain: bool = True
    tag: str = ""
    answers: list[str] = field(default_factory=list)


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


def random_text(rng: random.Random, n_words: int) -> str:
    words = random_words(rng, n_words)
    return words[:1].upper() + words[1:] + "."


def question(rng: random.Random, n_words: int) -> str:
    return f"{rng.choice(QUESTION_WORDS).capitalize()} {random_words(rng, max(1, n_words - 1))}?"


def _rng(kind: str, seed: int, *shape: int) -> random.Random:
    """One generator per workload kind, seed and shape, so that two workloads never start with
    the same words by accident (a shared first block is a prefix-cache hit)."""
    return random.Random(":".join([kind, str(seed), *map(str, shape)]))


def random_dataset(n: int, input_len: int, cal: Calibration, seed: int,
                   kind: str = "random") -> list[Conversation]:
    rng = _rng(kind, seed, n, input_len)
    words = cal.words_for(input_len)
    return [Conversation([random_text(rng, words)], tag="random") for _ in range(n)]


def shared_prefix_dataset(n: int, input_len: int, prefix_len: int, num_prefixes: int,
                          cal: Calibration, seed: int) -> list[Conversation]:
    """Each request: one of num_prefixes system prompts (~prefix_len tokens) plus a short unique
    question (~input_len tokens, chat-template overhead included). Every prompt gets the same
    number of requests (n // num_prefixes; the first n % num_prefixes one more), in an order
    shuffled by the seed, as vLLM's prefix-repetition and SGLang's generated-shared-prefix
    workloads do: with a random draw per request one prompt could get 22 of 64 requests and
    another 10, and a run would measure that draw as much as the caching and routing."""
    rng = _rng("shared-prefix", seed, n, input_len, prefix_len, num_prefixes)
    prefixes = [f"Document {i + 1}. " + random_text(rng, cal.words_for(prefix_len, False))
                for i in range(num_prefixes)]
    q_words = cal.words_for(input_len)
    order = [i % num_prefixes for i in range(n)]
    rng.shuffle(order)
    out = []
    for k in order:
        out.append(Conversation([question(rng, q_words)], system=prefixes[k], plain=True,
                                tag=f"prefix-{k}"))
    return out


def chat_dataset(n_requests: int, input_len: int, turns: int, cal: Calibration,
                 seed: int) -> list[Conversation]:
    """Conversations of `turns` user messages (~input_len tokens each); the last one may be
    shorter so that there are exactly n_requests requests. Later turns resend the history."""
    rng = _rng("chat", seed, n_requests, input_len, turns)
    words = cal.words_for(input_len)
    out = []
    remaining = n_requests
    while remaining > 0:
        k = min(turns, remaining)
        out.append(Conversation([question(rng, words) for _ in range(k)], plain=False,
                                tag="chat"))
        remaining -= k
    return out


def extractive_dataset(path: str | None = None) -> list[Conversation]:
    """The extractive set (benchmarks/data/extractive.jsonl): chat requests whose answers copy
    text of their prompts (code, text and JSON edits, quoting answers), tagged by kind."""
    import json
    from pathlib import Path

    file = Path(path) if path else Path(__file__).parents[1] / "data" / "extractive.jsonl"
    out = []
    for line in file.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(Conversation([item["messages"][-1]["content"]], plain=False,
                                    tag=item["kind"]))
    return out


def token_dataset(n: int, input_len: int, n_vocab: int, seed: int,
                  low: int = 256) -> list[list[int]]:
    """Random token-id prompts (for /v1/completions and the raw engine loop), away from the
    special tokens at the start of the vocabulary."""
    rng = _rng("tokens", seed, n, input_len)
    return [[rng.randrange(low, n_vocab) for _ in range(input_len)] for _ in range(n)]


# ---- rendering one request ----------------------------------------------------------------------
def chat_messages(conv: Conversation, turn: int) -> list[dict]:
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for i in range(turn):
        messages.append({"role": "user", "content": conv.user_turns[i]})
        messages.append({"role": "assistant", "content": conv.answers[i]})
    messages.append({"role": "user", "content": conv.user_turns[turn]})
    return messages


def completion_prompt(conv: Conversation, turn: int) -> str | list[int]:
    user = conv.user_turns[turn]
    if conv.plain and turn == 0:
        if not isinstance(user, str) or conv.system is None:
            return user
        return f"{conv.system}\n\n{user}"
    lines = [f"System: {conv.system}\n"] if conv.system else []
    for i in range(turn):
        lines += [f"User: {conv.user_turns[i]}", f"Assistant: {conv.answers[i]}"]
    lines += [f"User: {user}", "Assistant:"]
    return "\n".join(lines)
