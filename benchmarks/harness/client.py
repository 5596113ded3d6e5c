"""One streamed OpenAI-compatible request, timed chunk by chunk; the loopback-only guard."""
from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx


class NotLoopback(ValueError):
    pass


def check_loopback(base_url: str) -> str:
    """Benchmarks only talk to servers on this machine: the URL's host must be loopback."""
    url = urlparse(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise NotLoopback(f"not an http(s) URL: {base_url!r}")
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(url.hostname, None)}
    except socket.gaierror as exc:
        raise NotLoopback(f"cannot resolve {url.hostname!r}: {exc}") from exc
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise NotLoopback(f"{base_url} is not a loopback address (benchmarks run locally only)")
    return base_url.rstrip("/")


def make_client(concurrency: int, timeout: float) -> httpx.AsyncClient:
    n = concurrency + 4
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits,
                             trust_env=False)


def first_model(base_url: str) -> str:
    """The first model id the server lists (llama-server accepts any name; ours needs its own)."""
    r = httpx.get(f"{base_url}/v1/models", timeout=10.0, trust_env=False)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


@dataclass
class RequestOutput:
    ok: bool = False
    error: str = ""
    start: float = 0.0                 # perf_counter when the request was sent
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)   # one per chunk carrying text
    # one per chunk carrying a token, text or not: with logprobs asked for, a token without
    # text (a control token) still comes in a chunk of its own
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    drafted: int | None = None         # llama-server's timings: drafted tokens it verified
    draft_accepted: int | None = None  # and of those, accepted (speculative decoding)

    @property
    def ttft(self) -> float:
        if self.chunk_times:
            return self.chunk_times[0] - self.start
        # an answer whose tokens carried no text (a one-token answer that is a stop token, say)
        # still had its first token by the end of the request
        return self.latency if self.ok and self.output_tokens else 0.0

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1 or not self.chunk_times:
            return None
        return (self.end - self.chunk_times[0]) / (self.output_tokens - 1)

    def record(self) -> dict:
        return {"ok": self.ok, "error": self.error, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens,
                "usage_reported": self.usage_reported, "finish_reason": self.finish_reason,
                "ttft_s": self.ttft, "latency_s": self.latency, "tpot_s": self.tpot,
                "chunks": len(self.chunk_times), "max_itl_s": max(self.itl, default=None)}


def payload(model: str, prompt_or_messages, chat: bool, max_tokens: int, ignore_eos: bool,
            temperature: float = 0.0, stream: bool = True, extra: dict | None = None) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
            "stream": stream}
    body["messages" if chat else "prompt"] = prompt_or_messages
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra or {})
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, chat: bool,
               timeout: float, out: RequestOutput | None = None,
               headers: dict[str, str] | None = None) -> RequestOutput:
    """POST a streaming request and time every chunk that carries text. Output tokens come from
    the server's usage when it reports one, else one token per text chunk. Pass `out` to keep
    what arrived when the caller cancels the request."""
    out = out or RequestOutput()
    out.start = time.perf_counter()
    parts: list[str] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    out.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return out
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if obj.get("error"):
                        out.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                        return out
                    _read_chunk(obj, chat, now, out, parts)
    except TimeoutError:
        out.error = f"timed out after {timeout:.0f} s"
    except asyncio.CancelledError:
        out.error = "cancelled"
        raise
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.end = time.perf_counter()
        out.text = "".join(parts)
        if not out.usage_reported:
            out.output_tokens = len(out.chunk_times)
    if not out.error and out.finish_reason is None:
        out.error = "stream ended without a finish_reason"
    out.ok = not out.error
    return out


def _read_chunk(obj: dict, chat: bool, now: float, out: RequestOutput, parts: list[str]) -> None:
    usage = obj.get("usage")
    if usage:
        out.usage_reported = True
        out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        out.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            out.cached_tokens = int(details["cached_tokens"])
    timings = obj.get("timings")   # llama-server: prompt tokens taken from its cache
    if timings and timings.get("cache_n") is not None and out.cached_tokens is None:
        out.cached_tokens = int(timings["cache_n"])
    if timings and timings.get("draft_n") is not None:   # and its speculative decoding
        out.drafted = int(timings["draft_n"])
        out.draft_accepted = int(timings.get("draft_n_accepted") or 0)
    for choice in obj.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if text:
            out.chunk_times.append(now)
            parts.append(text)
        logprobs = choice.get("logprobs") or {}
        if text or logprobs.get("tokens") or logprobs.get("content"):
            out.token_times.append(now)
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]


async def complete(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """A non-streamed request (probes); raises on an HTTP error."""
    resp = await client.post(url, json={**body, "stream": False})
    resp.raise_for_status()
    return resp.json()
