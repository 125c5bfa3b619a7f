"""Replays a trace against an OpenAI-compatible server and collects request records.

Each request is sent at its trace arrival time (relative to the benchmark start), waits for a
slot when ``max_concurrency`` is set, and streams its answer. The benchmark ends when every
request has finished or failed.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from duetserve.bench.client import RequestRecord, send_request
from duetserve.bench.prompts import PromptBuilder, Tokenizer
from duetserve.traces import TraceRequest


@dataclass
class BenchConfig:
    """Where and how to send the requests.

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000``.
        endpoint: ``/v1/completions`` (token-id prompts) or ``/v1/chat/completions`` (text).
        model: model name to request; ``None`` asks the server (first id of ``/v1/models``).
        api_key: sent as a bearer token when set.
        max_concurrency: most requests in flight at once; ``None`` for no cap.
        request_timeout_s: limit on one whole request, seconds.
        seed: prompt seed.
        token_id_range: ``[low, high)`` of the ids in token-id prompts.
        progress: show a progress bar.
    """

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    seed: int = 0
    token_id_range: tuple[int, int] = (1000, 32000)
    progress: bool = True

    @property
    def is_chat(self) -> bool:
        """True for the chat completions endpoint."""
        return self.endpoint.rstrip("/").endswith("/chat/completions")

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers for every request."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class BenchRun:
    """Raw outcome of one run.

    Attributes:
        model: the model name requested.
        records: one record per trace request, in trace order.
        duration_s: wall time from the benchmark start to the last request's end, seconds.
        start_time_unix: Unix time of the benchmark start, seconds (to align server logs).
    """

    model: str
    records: list[RequestRecord]
    duration_s: float
    start_time_unix: float


def _reason(e: Exception) -> str:
    """``TYPE: MESSAGE``, or ``TYPE`` alone: httpx's timeouts have no message."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def fetch_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id listed by ``GET {base_url}/v1/models``.

    Raises:
        RuntimeError: the request fails or the list is empty.
    """
    try:
        resp = await client.get(f"{base_url}/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise RuntimeError(f"could not read a model id from {base_url}/v1/models: {_reason(e)}") from e


async def check_reachable(client: httpx.AsyncClient, base_url: str) -> None:
    """Raise RuntimeError when nothing answers at ``base_url`` (``GET /v1/models``; any HTTP status,
    a 404 included, is an answer): with ``--model`` given, every request failed instead, exit 2."""
    try:
        await client.get(f"{base_url}/v1/models")
    except httpx.TransportError as e:
        raise RuntimeError(f"server not reachable at {base_url}: {_reason(e)}") from e


def _payload(model: str, prompt: list[int] | str, output_len: int, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def run_benchmark(
    requests: list[TraceRequest], config: BenchConfig, tokenizer: Tokenizer | None = None
) -> BenchRun:
    """Replay ``requests`` against the server of ``config``.

    Args:
        requests: the trace, arrivals in seconds from the start.
        config: server and client settings.
        tokenizer: checks text prompts (chat endpoint) when given.

    Returns:
        The run's records (failures included) and timing.

    Raises:
        RuntimeError: the server is not reachable, or the model id cannot be fetched from it.
        ValueError: bad prompt settings (see :class:`PromptBuilder`).
    """
    builder = PromptBuilder(config.seed, config.token_id_range, tokenizer)
    build = builder.text if config.is_chat else builder.token_ids
    url = config.base_url.rstrip("/") + config.endpoint
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    slots = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(
        headers=config.headers,
        timeout=httpx.Timeout(config.request_timeout_s),
        limits=limits,
        trust_env=False,
    ) as client:
        base_url = config.base_url.rstrip("/")
        if config.model:
            await check_reachable(client, base_url)
        model = config.model or await fetch_model_id(client, base_url)
        bar = tqdm(total=len(requests), disable=not config.progress, unit="req")
        failed = 0

        async def one(index: int, req: TraceRequest) -> RequestRecord:
            nonlocal failed
            record = RequestRecord(index, req.input_len, req.output_len, req.arrival_s)
            await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            try:
                prompt = await asyncio.to_thread(build, index, req)
            except ValueError as e:
                record.error = f"prompt: {e}"
            else:
                payload = _payload(model, prompt, req.output_len, config.is_chat)
                async with slots:
                    await send_request(
                        client, url, payload, record, start, config.request_timeout_s,
                        check_prompt_tokens=not config.is_chat,
                    )
            failed += not record.success
            bar.set_postfix(failed=failed, refresh=False)
            bar.update()
            return record

        start_unix, start = time.time(), time.perf_counter()
        try:
            records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
            duration = time.perf_counter() - start
        finally:  # after Ctrl-C too: its line ends before the next message, not at exit after it
            bar.close()
    return BenchRun(model, list(records), duration, start_unix)
