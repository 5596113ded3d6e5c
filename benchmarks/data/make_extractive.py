"""Writes benchmarks/data/extractive.jsonl: chat requests whose answers repeat text of their
prompt, the work speculative decoding without a draft model is for (benchmarks.speculative).

Four kinds, 8 requests each, a user message of ~250-350 words (~400 prompt tokens with the chat
template) asking for an answer of ~150 tokens that mostly copies from it:
- code: return a function with a variable renamed, a parameter added, a loop rewritten;
- text: a paragraph with its spelling fixed or a word replaced throughout;
- json: a configuration with one value changed, returned whole;
- quote: answer a question by quoting the sentences of a passage that answer it.

The material is written here (code and configurations) or taken from this project's own docs
(paragraphs), and frozen in the JSONL file, so the set does not move when the docs do.

    python -m benchmarks.data.make_extractive      # rewrites the file (deterministic)
"""
from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("extractive.jsonl")

CODE = [
    ("python", "total", "running_total", '''def summarize_orders(orders, tax_rate):
    """Totals per customer, with tax, skipping cancelled orders."""
    totals = {}
    for order in orders:
        if order.get("status") == "cancelled":
            continue
        customer = order["customer"]
        total = 0.0
        for item in order["items"]:
            price = item["price"] * item["quantity"]
            if item.get("discount"):
                price -= price * item["discount"]
            total += price
        total += total * tax_rate
        totals[customer] = totals.get(customer, 0.0) + total
    return totals'''),
    ("python", "buf", "buffer", '''def read_frames(stream, frame_size, max_frames=None):
    """Reads fixed-size frames from a binary stream until it ends."""
    frames = []
    buf = b""
    while max_frames is None or len(frames) < max_frames:
        chunk = stream.read(frame_size - len(buf))
        if not chunk:
            break
        buf += chunk
        if len(buf) == frame_size:
            frames.append(buf)
            buf = b""
    if buf:
        raise ValueError(f"stream ended inside a frame ({len(buf)} bytes)")
    return frames'''),
    ("javascript", "res", "response", '''async function fetchUsers(baseUrl, ids, token) {
  const users = [];
  for (const id of ids) {
    const res = await fetch(`${baseUrl}/users/${id}`, {
      headers: { Authorization: `Bearer ${token}` },
    });
    if (res.status === 404) {
      continue;
    }
    if (!res.ok) {
      throw new Error(`request for user ${id} failed: ${res.status}`);
    }
    const body = await res.json();
    users.push({ id, name: body.name, email: body.email });
  }
  return users;
}'''),
    ("python", "n", "count", '''def histogram(values, bins, low, high):
    """Counts of values in equal-width bins between low and high."""
    if high <= low:
        raise ValueError("high must be above low")
    width = (high - low) / bins
    n = [0] * bins
    for value in values:
        if value < low or value >= high:
            continue
        index = int((value - low) / width)
        n[min(index, bins - 1)] += 1
    return n'''),
    ("go", "err", "readErr", '''func LoadConfig(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	var cfg Config
	if err := json.Unmarshal(data, &cfg); err != nil {
		return nil, fmt.Errorf("parsing %s: %w", path, err)
	}
	if cfg.Port == 0 {
		cfg.Port = 8080
	}
	if cfg.Workers <= 0 {
		cfg.Workers = runtime.NumCPU()
	}
	return &cfg, nil
}'''),
    ("python", "seen", "visited", '''def shortest_path(graph, start, goal):
    """Breadth-first search; returns the list of nodes from start to goal, or None."""
    queue = deque([start])
    seen = {start: None}
    while queue:
        node = queue.popleft()
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = seen[node]
            return path[::-1]
        for neighbour in graph.get(node, ()):
            if neighbour not in seen:
                seen[neighbour] = node
                queue.append(neighbour)
    return None'''),
    ("javascript", "acc", "result", '''function groupBy(items, keyFn) {
  const acc = {};
  for (const item of items) {
    const key = keyFn(item);
    if (!(key in acc)) {
      acc[key] = [];
    }
    acc[key].push(item);
  }
  for (const key of Object.keys(acc)) {
    acc[key].sort((a, b) => a.createdAt - b.createdAt);
  }
  return acc;
}'''),
    ("python", "lines", "rows", '''def parse_csv(text, delimiter=","):
    """Parses simple CSV text (no quoting) into a list of dicts keyed by the header."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = [name.strip() for name in lines[0].split(delimiter)]
    records = []
    for number, line in enumerate(lines[1:], start=2):
        fields = [field.strip() for field in line.split(delimiter)]
        if len(fields) != len(header):
            raise ValueError(f"line {number}: {len(fields)} fields, expected {len(header)}")
        records.append(dict(zip(header, fields)))
    return records'''),
]

CODE_CONTEXT = {
    "python": '''import json
import logging
from collections import deque

log = logging.getLogger(__name__)

RETRIES = 3


def load_settings(path):
    with open(path) as f:
        return json.load(f)

''',
    "javascript": '''import { readFile } from "node:fs/promises";

const RETRIES = 3;

export async function loadSettings(path) {
  return JSON.parse(await readFile(path, "utf8"));
}

''',
    "go": '''package config

import (
	"encoding/json"
	"fmt"
	"os"
	"runtime"
)

type Config struct {
	Port    int    `json:"port"`
	Workers int    `json:"workers"`
	LogDir  string `json:"log_dir"`
}

''',
}

# paragraphs of this project's docs, a few words misspelt on purpose (text edits)
PARAGRAPHS = [
    "Each step of a context's worker thread takes new and cancelled requests from its inbox, asks "
    "the scheduler for a plan, applies its KV operations and runs the batch through llama_decode. "
    "With a split KV cache the worker hands llama.cpp one call for the decode tokens, in seq-id "
    "order, and one call per prompt-chunk length, so that a prompt piece is never cut in two. It "
    "then samples every sequence that produced logits, right after its call, since the next "
    "decode overwrites them, registers newly filled KV blocks in the prefix cache and hands the "
    "new text to each request's queue with one wake-up of the event loop.",
    "Requests that share a prefix, such as a system prompt or a chat history, do not compute it "
    "again: the server keeps a paged index of the KV cells llama.cpp already holds and copies them "
    "to a new sequence. Every full block a sequence computes is registered under a chained hash of "
    "its parent's hash and its own token ids, and a hit also compares the token ids. When a request "
    "finishes, its cached blocks stay until eviction removes them, tail blocks first, so that the "
    "next turn of a chat finds its whole history in the cache.",
    "A busy neighbour stalls llama.cpp's threads. Four concurrent chats on two threads ran at 138 "
    "tokens a second alone and at 1.4 tokens a second while one other process kept one core busy. "
    "The threads meet at a barrier after every graph operation, and when one of them shares its "
    "core with another runnable thread the kernel deschedules it for a whole time slice while every "
    "other thread waits at the next barrier. A thread governor therefore gives threads up while "
    "other processes use the cores and takes them back when they leave.",
    "Prompts are cut on a fixed grid of sixteen tokens. While streams decode, a step computes at "
    "most as many prompt tokens as one grid cell for every prompt that wants one would give, so the "
    "streams' steps are no longer. Pieces always end on the grid and a one-token tail stays a piece "
    "of its own, so cutting never changes an answer. When many requests arrive together, the first "
    "ones finish their prompts steps earlier instead of all of them finishing together in the last "
    "step.",
    "Preemption saves a sequence's KV state to memory and restores it when the sequence resumes, "
    "which is much faster than computing its tokens again: for a thousand tokens the swap took "
    "fifty-six milliseconds and the recompute more than eight seconds. A sequence is also "
    "preempted when llama_decode finds no room in the KV cache. Admission control accepts at most "
    "the running sequences plus the queue per context, and answers the others with status 429 and "
    "a Retry-After header of one second.",
    "The server answers the OpenAI API strictly: a field it does not implement is an error, never "
    "silently ignored. It serves chat completions, completions, the Responses API, embeddings, "
    "tools, structured output, log probabilities, several choices per request and echo. Streams "
    "send their text as it is generated, with the usage in the last chunk when it is asked for. "
    "Anthropic's Messages API is served over the same service, so clients built on either "
    "software development kit can use one server.",
    "Measured on a two-core virtual machine, the same greedy request sent twice, the second time "
    "from the prefix cache, gave identical text ten times out of ten, where another server gave "
    "identical text five times out of ten. Exact answers rest on the kernels the engine picks: "
    "weights in their plain layouts, flash attention on a path that computes every query row the "
    "same way whatever the batch, and a split KV cache in which each sequence attends only to its "
    "own cells.",
    "Replicas of a model can run behind a cache-aware router, which sends each request to the "
    "replica that already holds the longest part of its prompt. On a workload of four shared "
    "system prompts of about five hundred tokens, the cache-aware policy served more requests a "
    "second than round robin in most seeds, with a hit rate of about eighty-five percent. The "
    "container images read the same environment variables as the server, plus the host and port "
    "to listen on.",
]

MISSPELLINGS = {"the": "teh", "which": "wich", "receive": "recieve", "because": "becuase",
                "request": "reqest", "sequence": "sequnce", "their": "thier", "second": "secnod",
                "server": "sever", "answers": "answres"}


def misspell(text: str, rng: random.Random) -> tuple[str, list[str]]:
    words = text.split(" ")
    hits = []
    for i, w in enumerate(words):
        bare = w.strip(",.:;")
        if bare in MISSPELLINGS and rng.random() < 0.5 and len(hits) < 4:
            words[i] = w.replace(bare, MISSPELLINGS[bare])
            hits.append(bare)
    return " ".join(words), hits


def config(rng: random.Random, name: str) -> dict:
    return {
        "service": name,
        "version": f"{rng.randint(1, 4)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}",
        "listen": {"host": "0.0.0.0", "port": rng.choice([8000, 8080, 9000, 3000]),
                   "tls": rng.random() < 0.5},
        "database": {"driver": rng.choice(["postgres", "mysql", "sqlite"]),
                     "host": f"db-{rng.randint(1, 9)}.internal", "pool_size": rng.randint(4, 32),
                     "timeout_ms": rng.choice([500, 1000, 2500])},
        "cache": {"enabled": True, "ttl_seconds": rng.choice([60, 300, 3600]),
                  "max_entries": rng.choice([1000, 10000, 50000])},
        "logging": {"level": rng.choice(["info", "warning", "debug"]),
                    "format": rng.choice(["json", "text"]), "file": f"/var/log/{name}.log"},
        "features": {f: rng.random() < 0.5 for f in ("search", "export", "beta_ui", "audit")},
        "workers": rng.randint(2, 16),
        "allowed_origins": [f"https://{w}.example.com" for w in rng.sample(
            ["app", "admin", "docs", "api", "shop"], 3)],
    }


JSON_EDITS = [
    ("set listen.port to 8443", lambda c: c["listen"].__setitem__("port", 8443)),
    ("set logging.level to \"error\"", lambda c: c["logging"].__setitem__("level", "error")),
    ("set database.pool_size to 64", lambda c: c["database"].__setitem__("pool_size", 64)),
    ("turn features.audit on (true)", lambda c: c["features"].__setitem__("audit", True)),
    ("set cache.ttl_seconds to 120", lambda c: c["cache"].__setitem__("ttl_seconds", 120)),
    ("set workers to 4", lambda c: c.__setitem__("workers", 4)),
    ("set database.timeout_ms to 5000", lambda c: c["database"].__setitem__("timeout_ms", 5000)),
    ("set listen.tls to false", lambda c: c["listen"].__setitem__("tls", False)),
]

QUOTES = [
    (0, "Why does the worker sample right after each call?"),
    (1, "What happens to a request's cached blocks when it finishes?"),
    (2, "Why does a busy neighbour slow llama.cpp down?"),
    (3, "Why does cutting prompts on the grid never change an answer?"),
    (4, "How much faster is a swap than a recompute?"),
    (5, "What does the server do with a field it does not implement?"),
    (6, "What do exact answers rest on?"),
    (7, "Where does the cache-aware router send a request?"),
]


def requests() -> list[dict]:
    rng = random.Random(20261127)
    out = []
    for lang, old, new, code in CODE:
        other = CODE[(CODE.index((lang, old, new, code)) + 3) % len(CODE)][3]
        module = CODE_CONTEXT[lang] + code + "\n\n\n" + other + "\n"
        out.append({"kind": "code", "messages": [{"role": "user", "content": (
            f"Here is a {lang} file:\n\n```{lang}\n{module}```\n\nIn the first function after "
            f"the settings loader, rename the variable `{old}` to `{new}` everywhere. Return "
            f"only that function, complete, in a code block, with no explanation.")}]})
    for paragraph in PARAGRAPHS:
        text, _ = misspell(paragraph, rng)
        extra = PARAGRAPHS[(PARAGRAPHS.index(paragraph) + 1) % len(PARAGRAPHS)]
        out.append({"kind": "text", "messages": [{"role": "user", "content": (
            f"Background, for context only:\n{extra}\n\nParagraph to correct:\n{text}\n\n"
            "Fix the spelling mistakes in the paragraph to correct and return the whole "
            "corrected paragraph, unchanged otherwise, with nothing before or after it.")}]})
    names = ["billing", "search", "gateway", "reports", "inventory", "auth", "mailer", "media"]
    for (what, edit), name in zip(JSON_EDITS, names):
        cfg = config(rng, name)
        before = json.dumps(cfg, indent=2)
        out.append({"kind": "json", "messages": [{"role": "user", "content": (
            f"This is the configuration of the {name} service:\n\n```json\n{before}\n```\n\n"
            f"Edit it: {what}. Return the complete edited JSON in a code block and nothing "
            "else.")}]})
        edit(cfg)
    for i, question_text in QUOTES:
        passage = " ".join([PARAGRAPHS[i], PARAGRAPHS[(i + 3) % len(PARAGRAPHS)]])
        out.append({"kind": "quote", "messages": [{"role": "user", "content": (
            f"Source:\n\"\"\"\n{passage}\n\"\"\"\n\nQuestion: {question_text}\nAnswer by "
            "quoting, word for word, the sentences of the source that answer the question, "
            "each in double quotes, then say in one sentence what they mean.")}]})
    return out


def main() -> None:
    with OUT.open("w") as f:
        for r in requests():
            f.write(json.dumps(r) + "\n")
    print(f"wrote {OUT} ({len(requests())} requests)")


if __name__ == "__main__":
    main()
