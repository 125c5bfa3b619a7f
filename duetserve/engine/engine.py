"""The LLM engine: requests in, token and text deltas out, one iteration per ``step()``."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from duetserve.config import EngineConfig
from duetserve.engine.cuda_graphs import DecodeGraphs, allocate_decode_logits
from duetserve.engine.detokenizer import IncrementalDetokenizer
from duetserve.engine.kv_cache import BlockManager
from duetserve.engine.model_runner import (
    ModelRunner,
    allocate_kv_cache,
    allocate_split_counters,
    kv_bytes_per_block,
)
from duetserve.engine.piecewise_graphs import PiecewiseGraphs
from duetserve.engine.policy import Plan, make_policy
from duetserve.engine.sampler import Sampler
from duetserve.engine.scheduler import ScheduledSeq, Scheduler
from duetserve.engine.sequence import Sequence
from duetserve.model.backends import make_attention_backend
from duetserve.model.loader import load_model
from duetserve.partition import PartitionBackend, make_partition_backend
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import load_profile
from duetserve.sampling import ParamError, SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RequestOutput:
    """What one iteration produced for one request.

    Attributes:
        request_id: the caller's id.
        new_token_ids: tokens generated this iteration (several after a look-ahead plan).
        new_text: text delta (may be empty while a multi-byte character or stop string is pending).
        finished: the request ended this iteration.
        finish_reason: ``stop``, ``length`` or ``abort`` when finished.
        num_prompt_tokens / num_output_tokens: usage counts so far, tokens.
        stop_reason: what a ``stop`` finish matched, as vLLM reports it: the stop string, or the
            token id from ``stop_token_ids``; None for EOS and any other finish.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    stop_reason: str | int | None = None


@dataclass
class StepStats:
    """One iteration, for metrics: plan, sizes, wall time (seconds), the decode steps that
    ran (at most ``plan.k``: a spatial plan stops at its prefill's end), for plans on
    CUDA streams each stream's busy seconds between CUDA events (``{"decode": s,
    "prefill": s}``; for temporal plans ``{"gpu": s}``, the GPU's span from the forward's first
    kernel to the sampler's last; empty on the CPU), the ``scheduled``
    sequences (decodes first), whose ``num_new_tokens`` / ``num_cached_tokens`` are the
    ``(q, c)`` they were scheduled with, and ``schedule_s``, the wall seconds of
    ``Scheduler.schedule`` (the policy's plan included; part of ``duration_s``). For plans with
    look-ahead decode steps, ``handout_s`` holds the wall seconds from the iteration's start at
    which each step's tokens were handed out, and ``launch_s`` those at which the prefill had
    been launched (None without a prefill launched beside decode steps: temporal plans, decode-only
    multi-step plans). ``gap_s``: wall seconds from the end of the iteration before (work was left
    then) to this one's start, host time between iterations that ``duration_s`` leaves out
    (handing out outputs, metrics, new requests; the server's event loop holding the GIL); None
    for the first iteration after the engine ran out of work. On the H200 serving Azure traces
    it was 2-3 ms at the median, as reconstructed from the iteration logs' timestamps before this
    field existed (docs/benchmarks.md, twenty-seventh session)."""

    plan: Plan
    num_decodes: int
    num_prefill_tokens: int
    duration_s: float
    num_preempted: int
    decode_steps: int = 1
    stream_s: dict[str, float] = field(default_factory=dict)
    num_prefills: int = 0
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    schedule_s: float = 0.0
    handout_s: list[float] = field(default_factory=list)
    launch_s: float | None = None
    gap_s: float | None = None


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against (``check_request``): the vocabulary size (token ids),
    the context limit (tokens) and the KV cache (``num_blocks`` blocks of ``block_size`` tokens).
    Plain numbers, so a server can check requests for an engine in another process."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int


def check_request(limits: RequestLimits, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Validate a request before it is queued.

    Raises:
        ParamError: empty or too long prompt, token ids out of the vocabulary, bad sampling
            parameters, ``max_tokens`` beyond the context left after the prompt, or more KV
            blocks than the cache has.
    """
    params.validate()
    n = len(prompt_token_ids)
    if n == 0:
        raise ParamError("the prompt is empty", "prompt")
    vocab, max_len = limits.vocab_size, limits.max_model_len
    if any(not 0 <= t < vocab for t in prompt_token_ids):
        raise ParamError(f"prompt token ids must be in [0, {vocab})", "prompt")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise ParamError(f"stop_token_ids must be in [0, {vocab}), got {bad[0]}", "stop_token_ids")
    if n >= max_len:
        raise ParamError(f"this model's maximum context length is {max_len} tokens; the "
                         f"prompt has {n} tokens, leaving no room for output", "prompt")
    if n + params.max_tokens > max_len:
        raise ParamError(f"max_tokens={params.max_tokens} plus the {n}-token prompt exceeds the "
                         f"maximum context length of {max_len} tokens", "max_tokens")
    blocks_needed = -(-(n + params.max_tokens) // limits.block_size)
    if blocks_needed > limits.num_blocks:
        too_long = -(-(n + 1) // limits.block_size) > limits.num_blocks
        raise ParamError(f"the request needs {blocks_needed} KV blocks; the cache has "
                         f"{limits.num_blocks}", "prompt" if too_long else "max_tokens")


@dataclass
class _Request:
    request_id: str
    seq: Sequence
    detok: IncrementalDetokenizer


def _available_host_bytes() -> int | None:
    """Bytes of host memory available to a new allocation (``MemAvailable``), or None where
    ``/proc/meminfo`` does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` reports device memory running out: torch's ``OutOfMemoryError``, or a
    RuntimeError from a library that allocated on its own (cuBLAS' ``ALLOC_FAILED``, CUDA's
    ``out of memory`` from a graph or a kernel launch)."""
    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def split_levels(policy, partition: PartitionBackend) -> list[int]:
    """Decode SM counts to record split decode graphs for: the policy's own where it has them
    (``decode_levels``: pdmux's groups; none for the temporal policies, chunked and prefill-first),
    else every level of ``partition``; none without SM partitioning (``granularity`` 0)."""
    if not partition.granularity:
        return []
    return (getattr(policy, "decode_levels", None) or partition.levels)()


class LLMEngine:
    """Owns the model, the KV cache and the scheduler; not thread-safe (one loop drives it).

    Raises (constructor):
        FileNotFoundError / KeyError / ValueError: the model cannot be loaded or the config is invalid.
        ValueError: on CUDA, the memory the KV cache left does not hold the CUDA graphs, the warm-up
            or the largest iteration (``_run_largest_batch``); it names the flag to lower.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        dtype = config.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = _DTYPES[dtype]
        self.partition = self._partition_backend()  # before the model: an explicit backend may fail
        torch.manual_seed(config.seed)
        backend = make_attention_backend(config.attention_backend, self.device, config.block_size)
        loaded = load_model(config.model, backend, self.dtype, self.device, config.load_format,
                            config.max_model_len, config.seed)
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        self.max_model_len = config.max_model_len or self.model.dims.max_position_embeddings
        num_blocks = config.num_kv_blocks or self._blocks_from_memory()
        capacity = num_blocks * config.block_size
        log.info("KV cache: %d blocks of %d tokens (%d tokens)", num_blocks, config.block_size, capacity)
        self._check_cache_fits(num_blocks)
        if capacity < 2:  # a one-token prompt and its first output token
            raise ValueError(f"the KV cache holds {capacity} token(s) ({num_blocks} blocks of {config.block_size}): "
                             "no request fits; give it more (--num-kv-blocks, --block-size, "
                             "--kv-cache-memory-fraction, on a CPU --cpu-kv-cache-gb)")
        if self.max_model_len > capacity:  # one sequence of the longest context must fit (vLLM's check)
            if config.max_model_len is not None:
                raise ValueError(f"--max-model-len {config.max_model_len} is more than the KV cache holds "
                                 f"({capacity} tokens in {num_blocks} blocks of {config.block_size}); lower it, "
                                 "or give the cache more (--num-kv-blocks, --kv-cache-memory-fraction, on a CPU "
                                 "--cpu-kv-cache-gb)")
            log.warning("the KV cache holds %d tokens, fewer than the model's %d positions: serving a "
                        "context of at most %d tokens (--max-model-len)", capacity, self.max_model_len, capacity)
            self.max_model_len = capacity
        self.block_manager = BlockManager(num_blocks, config.block_size)
        # One extra block, owned by no sequence: CUDA-graph padding rows write their K/V there.
        kv = allocate_kv_cache(self.model, num_blocks + 1, config.block_size, self.dtype, self.device)
        self.sampler = Sampler(self.device, config.seed)
        policy = make_policy(dataclasses.replace(config, partition_backend=self.partition.name), loaded.config.to_dict())
        # One buffer of decode attention split counters for the graphs and the eager steps: no two
        # decode attention calls run at once (allocate_split_counters says why).
        counters = allocate_split_counters(self.model, config.max_num_seqs, self.device)
        try:  # what the KV cache left must hold the graphs and the largest iteration
            self.graphs, split_graphs = self._capture_graphs(kv, num_blocks, policy, counters)
            self.piecewise = self._capture_piecewise(kv, num_blocks * config.block_size)
            self.runner = ModelRunner(self.model, kv, config.block_size, self.device, self.sampler, self.graphs,
                                      self.partition, split_graphs, scratch_slot=num_blocks * config.block_size,
                                      split_counters=counters, piecewise=self.piecewise)
            start = time.perf_counter()
            self.runner.warm_up()
            log.info("ran the eager passes' kernel variants in %.1f s", time.perf_counter() - start)
            if self.device.type == "cuda":
                self._run_largest_batch(policy.chunked_prefill)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not _is_out_of_memory(exc):
                raise
            raise self._out_of_memory(exc) from exc
        self.runner.interrupt = self._interrupted
        self._interrupt: Callable[[], bool] | None = None
        # The served model's cost model on the configured profile, whatever the policy: the
        # iteration log's predictions for policies that do not plan with one (chunked).
        self.cost_model = CostModel(ModelShape.from_hf_config(loaded.config.to_dict()),
                                    load_profile(config.hardware_profile), cuda_graphs=self.graphs is not None,
                                    piecewise_tokens=self.piecewise.buckets[-1] if self.piecewise else 0)
        self.scheduler = Scheduler(policy, self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   decode_steps=config.num_decode_steps)
        self.eos_token_ids = self._eos_ids(loaded.config)
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self.last_stats: StepStats | None = None
        self._busy_since: float | None = None  # end of the last iteration, while work was left (StepStats.gap_s)

    def _partition_backend(self) -> PartitionBackend:
        """The SM partition backend: ``auto`` falls back quietly, an explicit one must work.

        Raises:
            ValueError: ``--partition-backend greenctx`` or ``tpcmask`` cannot run here (no CUDA
                device, or the backend failed to start or failed its self-test).
        """
        name = self.config.partition_backend
        backend = make_partition_backend(name, self.device)
        if name in ("auto", "none") or backend.name == name:
            return backend
        if self.device.type != "cuda":
            raise ValueError(f"--partition-backend {name} needs a CUDA device, not {self.device}; use auto or none")
        reason = getattr(backend, "reason", "") or backend.fallback_reason
        raise ValueError(f"--partition-backend {name} does not work on {self.device} ({reason}); use auto or none")

    def _capture_graphs(self, kv, scratch_block: int, policy, split_counters: torch.Tensor
                        ) -> tuple[DecodeGraphs | None, dict[int, DecodeGraphs]]:
        """Decode graphs for all SMs, and one set per split level the policy can pick (recorded
        on that level's decode stream), all in one memory pool, all on ``split_counters`` and one
        logits buffer."""
        backend = self.model.attention_backend
        graphs_ok = self.device.type == "cuda" and not self.config.enforce_eager and getattr(backend, "cuda_graph_safe",
                                                                                            False)
        if self.config.decode_stream and not graphs_ok:
            raise ValueError("--decode-stream needs decode CUDA graphs: a CUDA device, a graph-safe attention backend "
                             "and no --enforce-eager")
        if not graphs_ok:
            return None, {}
        bs = self.config.block_size
        stream_kernels = None
        if self.config.decode_stream:
            from duetserve.model.decode_stream import DecodeStream
            try:
                stream_kernels = DecodeStream(self.model, kv)
            except (ValueError, RuntimeError, ImportError) as exc:
                raise ValueError(f"--decode-stream cannot run here: {exc}") from exc

        logits = allocate_decode_logits(self.model, self.config.max_num_seqs, self.device)  # one for every set
        log.info("decode CUDA graphs share one logits buffer, %.1f MiB", logits.numel() * logits.element_size() / 2**20)

        def record(stream=None) -> DecodeGraphs:
            graphs = DecodeGraphs(self.model, kv, self.config.max_num_seqs, -(-self.max_model_len // bs),
                                  scratch_block * bs, self.device, stream, split_counters,
                                  stream_kernels if stream is None else None, logits)
            graphs.capture(pool)
            return graphs

        pool = torch.cuda.graph_pool_handle()
        full = record()
        return full, {s: record(self.partition.pair(s).decode) for s in split_levels(policy, self.partition)}

    def _capture_piecewise(self, kv, scratch_slot: int) -> PiecewiseGraphs | None:
        """Piecewise CUDA graphs for temporal iterations with prefill tokens, up to
        ``EngineConfig.piecewise_tokens`` tokens; None off CUDA, with ``enforce_eager`` or a limit of 0."""
        limit = self.config.piecewise_tokens
        if self.device.type != "cuda" or limit < 1:
            return None
        graphs = PiecewiseGraphs(self.model, kv, limit, scratch_slot, self.device)
        graphs.capture()
        return graphs

    def set_interrupt(self, check: Callable[[], bool]) -> None:
        """A multi-step decode iteration (``num_decode_steps``) starts no further step once
        ``check()`` is true, e.g. when a new request or an abort is waiting."""
        self._interrupt = check

    def _interrupted(self) -> bool:
        """Whether a multi-step decode iteration should start no further step: ``set_interrupt``'s
        check says new work waits, or a request that ended in it made room for the first waiting
        one (``Scheduler.can_admit``), which would otherwise wait for the iteration's last step."""
        return (self._interrupt is not None and self._interrupt()) or self.scheduler.can_admit()

    def _blocks_from_memory(self) -> int:
        per_block = kv_bytes_per_block(self.model, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = self.config.cpu_kv_cache_bytes
        return max(1, int(free * self.config.kv_cache_memory_fraction) // per_block - 1)

    def _check_cache_fits(self, num_blocks: int) -> None:
        """Raise ValueError, naming the flag, when ``num_blocks`` KV blocks (and the spare one)
        need more bytes than the device has free: CUDA's free memory (for ``--num-kv-blocks``; a
        cache sized from that memory fits), or the host's available memory (``MemAvailable`` of
        ``/proc/meminfo``, where there is one) on a CPU. Checked before
        anything is sized by ``num_blocks``, so an oversized cache is refused instead of running the
        host out of memory."""
        cuda = self.device.type == "cuda"
        if cuda and not self.config.num_kv_blocks:
            return  # sized from CUDA's free memory (``_blocks_from_memory``)
        need = (num_blocks + 1) * kv_bytes_per_block(self.model, self.config.block_size, self.dtype)
        free = torch.cuda.mem_get_info(self.device)[0] if cuda else _available_host_bytes()
        if free is None or need <= free:
            return
        flag = (f"--num-kv-blocks {self.config.num_kv_blocks}" if self.config.num_kv_blocks
                else f"--cpu-kv-cache-gb {self.config.cpu_kv_cache_bytes / 2**30:g}")
        raise ValueError(f"{flag}: the KV cache needs {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB "
                         f"free on {self.device}")

    def _largest_iteration_tokens(self, chunked_prefill: bool) -> int:
        """Most tokens one iteration can hold: the token budget where prompts are chunked to
        fit it; else (prefill-first, pdmux) a prompt over the budget runs whole, up to
        ``max_model_len - 1`` tokens, beside up to ``max_num_seqs - 1`` decodes under pdmux
        (``Scheduler.schedule``; prefill-first runs prompts without decodes, so the bound holds
        it with room to spare)."""
        cfg = self.config
        if chunked_prefill:
            return cfg.max_num_batched_tokens
        return max(cfg.max_num_batched_tokens, self.max_model_len - 1 + cfg.max_num_seqs - 1)

    def _run_largest_batch(self, chunked_prefill: bool) -> None:
        """Run the largest iteration once (``ModelRunner.run_largest_batch``: the
        ``_largest_iteration_tokens`` over ``max_num_seqs`` prompts of at most
        ``max_model_len`` tokens) after the KV cache, the CUDA graphs and the warm-up took their
        memory, and log what it took (CUDA only).

        Raises:
            torch.OutOfMemoryError: the device had not the memory for it.
        """
        tokens, prompts, peak = self.runner.run_largest_batch(self._largest_iteration_tokens(chunked_prefill),
                                                              self.config.max_num_seqs, self.max_model_len)
        spare = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device) \
            - torch.cuda.memory_allocated(self.device)
        log.info("the largest iteration (%d tokens over %d prompts) took %.2f GiB; %.2f GiB left (free, or held "
                 "unused by PyTorch's allocator)", tokens, prompts, peak / 2**30, spare / 2**30)

    def _out_of_memory(self, exc: BaseException) -> ValueError:
        """The start-up error for an out-of-memory after the KV cache was allocated: names the
        flag that sized the cache (``--num-kv-blocks`` or ``--kv-cache-memory-fraction``) and the
        three that size the largest iteration and the graphs, with the first three sentences of
        torch's message (what it tried to allocate, and what the GPU had free)."""
        cfg = self.config
        flag = (f"--num-kv-blocks {cfg.num_kv_blocks}" if cfg.num_kv_blocks
                else f"--kv-cache-memory-fraction {cfg.kv_cache_memory_fraction:g}")
        reason = ". ".join(str(exc).split(". ")[:3]).rstrip(".") or "out of memory"
        return ValueError(f"{flag}: the KV cache leaves too little memory on {self.device} for the CUDA graphs and "
                          f"the largest iteration (--max-num-batched-tokens {cfg.max_num_batched_tokens}, "
                          f"--max-num-seqs {cfg.max_num_seqs}, --max-model-len {self.max_model_len}): {reason}. "
                          f"Lower {flag.split()[0]}, or one of the other three")

    def _eos_ids(self, hf_config) -> frozenset[int]:
        ids = getattr(hf_config, "eos_token_id", None)
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # --- requests -------------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        """What requests are checked against (``check_request``)."""
        return RequestLimits(self.model.dims.vocab_size, self.max_model_len, self.config.block_size,
                             self.block_manager.num_blocks)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """``check_request`` against this engine's ``limits`` (raises ``ParamError``)."""
        check_request(self.limits, prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request (see ``check_request`` for the errors raised)."""
        if request_id in self._requests:
            raise ParamError(f"request id {request_id!r} is already running", "request_id")
        self.check_request(prompt_token_ids, params)
        seq = Sequence(next(self._ids), list(prompt_token_ids), len(prompt_token_ids), params,
                       arrival_time if arrival_time is not None else time.monotonic(), self.eos_token_ids)
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(request_id, seq, IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its KV blocks; its last output (finished, ``abort``, no new
        tokens, the text held back for stop strings), or None if it is unknown or finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req.seq, "abort")
        self.sampler.release(req.seq.seq_id)
        if not self.has_unfinished():  # the engine idles from here: no gap to the next iteration
            self._busy_since = None
        return RequestOutput(request_id, [], req.detok.finish(), True, "abort", req.seq.num_prompt_tokens,
                             req.seq.num_output_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_ids(self) -> list[str]:
        """Ids of the requests queued or running."""
        return list(self._requests)

    # --- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return every output it produced, in order (a request gets one
        output per look-ahead step of a spatial plan, see ``step_parts``)."""
        return [o for part in self.step_parts() for o in part]

    def step_parts(self) -> Iterator[list[RequestOutput]]:
        """Run one iteration, yielding outputs as soon as the device finishes each part: one
        list for a temporal plan; for a plan with ``k`` look-ahead decode steps, one list per
        step (one token per running decode), then one for the prefill batch. A request's
        outputs come in order. The last list (possibly empty) comes with ``last_stats`` set; it
        stays None before it, and for an iteration with nothing to run (nothing is yielded)."""
        start = time.perf_counter()
        gap_s = None if self._busy_since is None else start - self._busy_since
        self.last_stats = None
        out = self.scheduler.schedule()
        schedule_s = time.perf_counter() - start
        if out.is_empty:
            return
        emitted = {s.seq.seq_id: s.seq.num_tokens for s in out.scheduled}
        requests = [r for r in self._requests.values() if r.seq.seq_id in emitted]
        handout_s: list[float] = []  # each look-ahead decode step handed out (a temporal plan has none)
        for part in self.runner.execute(out):
            if not part.final:
                handout_s.append(time.perf_counter() - start)
            self.scheduler.advance(out, part.tokens, part.prefills)
            outputs = []
            for req in requests:
                seq = req.seq
                if req.request_id not in self._requests:
                    continue  # finished in an earlier part (a stop string)
                new_ids = seq.token_ids[emitted[seq.seq_id]:]
                emitted[seq.seq_id] = seq.num_tokens
                if new_ids or seq.is_finished:
                    outputs.append(self._emit(req, new_ids))
            if part.final:
                stream_s, steps = self.runner.last_stream_seconds, len(handout_s)
                duration = time.perf_counter() - start
                if out.plan.spatial and steps and stream_s.get("decode"):  # the policy learns from it
                    self.scheduler.policy.observe(out.plan, stream_s["decode"] / steps, stream_s.get("prefill"),
                                                  stream_s.get("tail"))
                elif not out.plan.spatial and out.decodes and out.num_prefill_tokens:
                    self.scheduler.policy.observe_iteration(out.plan, duration)
                self.last_stats = StepStats(out.plan, len(out.decodes), out.num_prefill_tokens,
                                            duration, len(out.preempted),
                                            steps or int(bool(out.decodes)),
                                            dict(stream_s), len(out.prefills), out.scheduled, schedule_s,
                                            handout_s, None if self.runner.last_launch_at is None
                                            else self.runner.last_launch_at - start, gap_s)
                self._busy_since = time.perf_counter() if self.has_unfinished() else None
            if outputs or part.final:
                yield outputs

    def _emit(self, req: _Request, new_ids: list[int]) -> RequestOutput:
        seq = req.seq
        shown = new_ids
        if new_ids and seq.stopped_by_token and not seq.params.include_stop_str_in_output:
            shown = new_ids[:-1]  # vLLM leaves the stop token's text out (the token is still counted)
        text, stop_str = req.detok.add(shown)
        stop_reason = stop_str
        if stop_str is not None:  # a stop string ends it, even on the token that also reached max_tokens
            self.scheduler.finish(seq, "stop")
            seq.finish_reason = "stop"
        elif new_ids and seq.stopped_by_token and not seq.stopped_by_eos:
            stop_reason = new_ids[-1]  # one of stop_token_ids
        if seq.is_finished:
            text += req.detok.finish()
            self._requests.pop(req.request_id, None)
            self.sampler.release(seq.seq_id)
        return RequestOutput(req.request_id, new_ids, text, seq.is_finished, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_output_tokens, stop_reason)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts (token ids) to completion together; returns each one's output token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        while any(r in self._requests for r in ids):
            for o in self.step():
                if o.request_id in results:
                    results[o.request_id].extend(o.new_token_ids)
        return [results[i] for i in ids]
