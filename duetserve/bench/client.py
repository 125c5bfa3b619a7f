"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

A chunk that carries text (``choices[0].text`` for completions, ``choices[0].delta.content``
or ``reasoning_content`` for chat) marks a token arrival; as in ``vllm bench serve``, a chunk
that carries several tokens counts as one arrival, so ITLs are per chunk. Output tokens are
counted from the final ``usage`` when the server sends it, otherwise as the number of text
chunks. Any problem (HTTP error, error event, connection closed before ``data: [DONE]``,
timeout, wrong token count) is recorded as the request's ``error``, never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

_ERROR_BODY_CHARS = 300


class StreamError(Exception):
    """The server answered, but not with a valid, complete stream."""


@dataclass
class RequestRecord:
    """Outcome of one benchmark request. All times are in seconds.

    Attributes:
        index: position of the request in the trace.
        input_len: prompt tokens sent.
        output_len: output tokens requested (``max_tokens``).
        arrival_s: scheduled send time, from the benchmark start.
        start_s: actual send time, from the benchmark start (later than ``arrival_s`` when
            the concurrency cap queues the request).
        chunk_times_s: arrival time of each text chunk, from ``start_s``.
        output_tokens: output tokens received (``usage.completion_tokens`` when sent).
        prompt_tokens: prompt tokens as counted by the server (``usage.prompt_tokens``).
        error: why the request failed; ``None`` for a success.
    """

    index: int
    input_len: int
    output_len: int
    arrival_s: float
    start_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        """True when the request completed with the requested token counts."""
        return self.error is None

    @property
    def ttft_s(self) -> float:
        """Time to first token: send to first text chunk."""
        return self.chunk_times_s[0]

    @property
    def e2el_s(self) -> float:
        """End-to-end latency: send to last text chunk."""
        return self.chunk_times_s[-1]

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (times rounded to microseconds)."""
        ok = bool(self.chunk_times_s)
        return {
            "index": self.index,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "arrival_s": round(self.arrival_s, 6),
            "start_s": round(self.start_s, 6),
            "ttft_s": round(self.ttft_s, 6) if ok else None,
            "e2el_s": round(self.e2el_s, 6) if ok else None,
            "itls_s": [round(x, 6) for x in self.itls_s],
            "error": self.error,
        }


def _chunk_text(chunk: dict[str, Any]) -> str:
    """The text a streamed completion or chat chunk carries ('' if none)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if delta is None:
        return choice.get("text") or ""
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def _stream(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], record: RequestRecord
) -> None:
    """POST ``payload`` and fill ``record`` from the SSE stream.

    Raises:
        StreamError: HTTP status other than 200, an error event, or no ``[DONE]``.
        httpx.HTTPError: transport failures, including a connection closed mid-stream.
        ValueError: a data line that is not JSON.
    """
    t0 = time.perf_counter()
    usage_seen = False
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            raise StreamError(f"HTTP {resp.status_code}: {body[:_ERROR_BODY_CHARS]}")
        async for line in resp.aiter_lines():
            now = time.perf_counter() - t0
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                if not usage_seen:
                    record.output_tokens = len(record.chunk_times_s)
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamError(f"error event: {str(chunk['error'])[:_ERROR_BODY_CHARS]}")
            if _chunk_text(chunk):
                record.chunk_times_s.append(now)
            usage = chunk.get("usage")
            if usage:
                usage_seen = True
                record.output_tokens = int(usage.get("completion_tokens") or 0)
                record.prompt_tokens = usage.get("prompt_tokens")
    raise StreamError("stream ended before data: [DONE]")


def _count_error(record: RequestRecord, check_prompt_tokens: bool) -> str | None:
    """Why the token counts of a finished stream are wrong, or ``None``."""
    if not record.chunk_times_s:
        return "no tokens received"
    if record.output_tokens != record.output_len:
        return f"expected {record.output_len} output tokens, got {record.output_tokens}"
    if check_prompt_tokens and record.prompt_tokens not in (None, record.input_len):
        return f"sent {record.input_len} prompt tokens, server counted {record.prompt_tokens}"
    return None


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    record: RequestRecord,
    bench_start: float,
    timeout_s: float,
    check_prompt_tokens: bool,
) -> RequestRecord:
    """Send one streamed request and fill ``record``; failures go to ``record.error``.

    Args:
        client: HTTP client to send with.
        url: full URL of the endpoint.
        payload: JSON body (must ask for ``stream: true``).
        record: the request's record; ``start_s``, timings, counts and ``error`` are set.
        bench_start: ``time.perf_counter()`` at the benchmark start.
        timeout_s: limit on the whole request, seconds.
        check_prompt_tokens: also require the server's prompt token count to equal
            ``record.input_len`` (token-id prompts).

    Returns:
        ``record``.
    """
    record.start_s = time.perf_counter() - bench_start
    try:
        await asyncio.wait_for(_stream(client, url, payload, record), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timeout after {timeout_s:g} s"
    except (StreamError, httpx.HTTPError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
    else:
        record.error = _count_error(record, check_prompt_tokens)
    return record
