"""Turns a scheduled batch into tensors, runs the model and samples.

Temporal plans run the whole batch once on the current stream. Spatial plans run up to ``k``
decode steps on the decode stream and the prefill batch on the prefill stream at the same
time (docs/design.md section 5; DuetServe's look-ahead decode): each step's sampled tokens feed the
next step on the device. Each step also copies its tokens into pinned host memory and records
an event, so the host hands a step's tokens out as soon as that step is done (clients see one
token per decode step, not a burst of ``k`` at the join), also while it is still launching the
prefill, which it does a layer at a time. Beyond the paper, decode starts no
step once the prefill is done, and a decode-only plan (multi-step decode) keeps the next step
queued behind the running one (``_execute_spatial``).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from duetserve.engine.cuda_graphs import DecodeGraphs
from duetserve.engine.piecewise_graphs import PiecewiseGraphs
from duetserve.engine.sampler import Sampler, SamplingBatch
from duetserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from duetserve.engine.sequence import Sequence
from duetserve.engine.upload import upload
from duetserve.model.attention import AttentionMetadata
from duetserve.model.decoder import CausalLM
from duetserve.partition import PartitionBackend
from duetserve.planner.optimizer import STEP_START_SHARE, executed_steps
from duetserve.sampling import SamplingParams

log = logging.getLogger(__name__)

_POLL_S = 5e-4  # seconds between polls of a prefill about to end (_prefill_leaves_a_step)


def allocate_kv_cache(model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    d = model.dims
    shape = (d.num_layers, 2, num_blocks, block_size, d.num_kv_heads, d.head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(d.num_layers)]


def allocate_split_counters(model: CausalLM, max_num_seqs: int, device: torch.device) -> torch.Tensor:
    """``[max_num_seqs * num_kv_heads]`` int32 zeros: the Triton decode attention's split counters
    (``AttentionMetadata.split_counters``), one buffer for every layer, step and decode graph.

    Each call leaves them at zero, so calls may share them as long as no two run at the same
    time, and no two do here: the spatial (duet) and layer-split (pdmux) paths run the prefill
    batch beside the decodes with ``num_decodes=0`` (``_prepare(out.prefills, 0, ...)``: prefill
    attention only, which reads no counter), and all of an iteration's decode steps, eager or
    replayed from a graph, run on its one decode stream, which the main stream joins before the
    next iteration. Tiny, so allocated whatever the backend (others ignore it).
    """
    return torch.zeros(max_num_seqs * model.dims.num_kv_heads, dtype=torch.int32, device=device)


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    d = model.dims
    return 2 * d.num_layers * block_size * d.num_kv_heads * d.head_dim * torch.finfo(dtype).bits // 8


@dataclass
class StepInputs:
    """Device inputs of one forward pass.

    Attributes:
        input_ids / positions: ``[T]`` int64.
        meta: attention metadata.
        sample_rows: ``[n]`` int64, rows of the hidden states that sample (None: every row).
        sample_seq_ids: seq ids of those rows, in order.
        sampling: the rows' sampling parameters on the device.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None
    sample_seq_ids: list[int]
    sampling: SamplingBatch


@dataclass
class Sampled:
    """One part of an iteration's results, in the order the device finished them.

    Attributes:
        tokens: seq_id -> the one token sampled for it in this part.
        prefills: True when this part completes the iteration's prefill batch (see
            ``Scheduler.advance``); False for a look-ahead decode step, and for the last part
            of a layer-split prefill round that left layers to run.
        final: the iteration's last part.
    """

    tokens: dict[int, int]
    prefills: bool
    final: bool = True


class _HostCopy:
    """A device tensor's copy into pinned host memory, readable once its event has fired
    (the copy is queued on the current stream; no host sync at launch)."""

    def __init__(self, values: torch.Tensor):
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = values, None

    def ready(self) -> bool:
        """Whether the copy has landed (never waits)."""
        return self.event is None or self.event.query()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class _StreamTimers:
    """CUDA events around each stream's work; read after the join (no extra host sync)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.events: dict[str, list] = {}

    def mark(self, name: str) -> None:
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.setdefault(name, []).append(event)

    def mark_end(self, name: str) -> None:
        """Record (or move) the end mark of ``name``, whose start is marked."""
        if self.enabled:
            del self.events[name][1:]
            self.mark(name)

    def elapsed(self, names: tuple[str, ...]) -> dict[str, float]:
        """Seconds between the two marks of each of the streams ``names`` that has them
        (empty on CPU); waits for those marks."""
        marked = {n: self.events[n] for n in names if n in self.events}
        for _, end in marked.values():
            end.synchronize()
        return {name: a.elapsed_time(b) / 1e3 for name, (a, b) in marked.items()}

    def end_gap(self, first: str, second: str) -> float | None:
        """Seconds from the end mark of ``first`` to that of ``second`` (negative when ``second``
        ended first), None unless both were marked; call after ``elapsed`` synchronized them."""
        if first not in self.events or second not in self.events:
            return None
        return self.events[first][-1].elapsed_time(self.events[second][-1]) / 1e3


def _split_key(out: SchedulerOutput) -> tuple:
    """Identity of a layer-split prefill batch: its sequences and chunks."""
    return tuple((s.seq.seq_id, s.num_cached_tokens, s.num_new_tokens) for s in out.prefills)


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Launch on ``stream`` (None: the current stream)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@dataclass
class _SpatialRun:
    """State of a spatial iteration in flight (``ModelRunner._execute_spatial``)."""

    out: SchedulerOutput
    decode_stream: torch.cuda.Stream | None
    prefill_stream: torch.cuda.Stream | None
    main: torch.cuda.Stream | None
    timers: _StreamTimers
    graphs: DecodeGraphs | None
    ids: torch.Tensor | None = None  # the last launched step's tokens, on the device
    launched: int = 0
    inflight: deque = field(default_factory=deque)  # _HostCopy of each launched step not yet read
    decode_ids: list[int] = field(default_factory=list)
    tables: list[np.ndarray] = field(default_factory=list)  # the decodes' block tables as scheduled
    sampling: SamplingBatch | None = None  # the decodes' sampling parameters, uploaded with step 0
    prefill_ids: list[int] = field(default_factory=list)
    prefill_copy: _HostCopy | None = None
    prefill_end: torch.cuda.Event | None = None  # recorded after the prefill on its own stream
    prefill_due: float | None = None  # host clock (perf_counter) at which the prefill is predicted to end
    hold_until: float | None = None  # host clock until which decode steps hold for the prefill's end
    partitioned: bool = False  # a prefill runs beside the decodes on its own (SM-partitioned) stream
    prefill_begun: bool = False  # the prefill's launch has begun (``_launch_prefill``)

    @property
    def beside_prefill(self) -> bool:
        """Decode steps run beside a prefill on its own stream, whose launch has begun."""
        return self.partitioned and self.prefill_begun


class ModelRunner:
    """Runs one iteration's plan on the model.

    Args:
        graphs: recorded decode graphs, replayed for decode-only temporal batches.
        partition: SM partition backend for spatial plans; None or ``none`` runs both parts
            of a spatial plan one after the other on the current stream (same tokens).
        split_graphs: decode graphs recorded on each split level's decode stream, by decode SMs.
        scratch_slot: a KV slot no sequence owns.
        split_counters: decode attention's split counters (``allocate_split_counters``), put into
            every batch's ``AttentionMetadata``, the same buffer as the graphs'; None: allocated
            per attention call.
        piecewise: piecewise graphs (on all SMs) replayed for temporal batches with prefill tokens
            that fit one of their buckets; others run eagerly.
    """

    def __init__(self, model: CausalLM, kv_caches, block_size: int, device: torch.device, sampler: Sampler,
                 graphs: DecodeGraphs | None = None, partition: PartitionBackend | None = None,
                 split_graphs: dict[int, DecodeGraphs] | None = None, scratch_slot: int = 0,
                 split_counters: torch.Tensor | None = None, piecewise: PiecewiseGraphs | None = None):
        self.split_counters = split_counters
        self.piecewise = piecewise
        self.split_graphs = split_graphs or {}
        self.scratch_slot = scratch_slot  # a KV slot no sequence owns (look-ahead steps past a request's end)
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.graphs = graphs
        self.partition = partition
        # spatial plans: busy time of each joined stream ("decode", "prefill") and "tail", from the
        # decode stream's end to the prefill's (0 when decode ended last)
        self.last_stream_seconds: dict[str, float] = {}
        self.last_launch_at: float | None = None  # spatial plans with a prefill: perf_counter() once it was launched
        self.prefill_done = True  # False after a layer-split prefill round that left layers to run
        # layer-split prefill in flight: (key, inputs, state, next layer, host copy of its tokens or None)
        self._split: tuple | None = None
        self._unjoined: torch.cuda.Stream | None = None  # prefill stream still running a split's layers
        self.interrupt: Callable[[], bool] | None = None  # True: stop a multi-step decode early

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the eager forward's kernel variants once, before any request: a 2-token prefill
        (context 2) after 0, 1 and 2 decodes (context 1), every K/V written to the scratch
        slot, every block table entry the scratch block. Nothing else in the cache changes.

        Triton compiles a kernel per 16-byte alignment of its pointer arguments, and the prefill
        attention gets its batch's ``context_lens``, ``query_start_loc`` and ``block_tables``
        sliced past the decodes (``TritonAttention.forward``): with block tables 2 entries wide,
        0, 1 and 2 decodes give all three alignments those slices can have (``context_lens``
        with ``query_start_loc`` aligned iff ``nd % 4 == 0``; the block tables iff ``nd * width % 4
        == 0``). Compiled on first use instead, each variant held an iteration for 0.8-1.2 s on
        the H200 (docs/benchmarks.md, fourteenth session). The decode attention's variants for
        every decode count and block-table width follow (the attention backend's
        ``compile_decode_variants``, where it has one), and the sampler's race kernel, where it
        samples."""
        block = self.scratch_slot // self.block_size
        i32 = {"dtype": torch.int32, "device": self.device}
        for nd in range(3):
            lens = [1] * nd + [2]
            meta = AttentionMetadata(
                slot_mapping=torch.full((nd + 2,), self.scratch_slot, dtype=torch.int64, device=self.device),
                query_start_loc=torch.tensor(np.cumsum([0] + lens), **i32),
                context_lens=torch.tensor(lens, **i32), block_tables=torch.full((nd + 1, 2), block, **i32),
                num_decodes=nd, query_lens_cpu=lens, context_lens_cpu=lens, split_counters=self.split_counters)
            positions = torch.tensor([0] * nd + [0, 1], dtype=torch.int64, device=self.device)
            hidden = self.model(torch.zeros(nd + 2, dtype=torch.int64, device=self.device), positions,
                                self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[-1:])
        backend = self.model.attention_backend
        if hasattr(backend, "compile_decode_variants") and self.split_counters is not None:
            backend.compile_decode_variants(self.model.dims.num_heads, *self.kv_caches[0], block, self.split_counters)
        if self.sampler.race:  # the race kernel compiles here, not in the first request's step; Triton
            # compiles a variant per pointer alignment, and the steps' positions are 16-byte aligned
            aligned = positions[-1:].clone()
            self.sampler.sample(logits, self.sampler.prepare([-1], [SamplingParams()], logits.shape[-1]), aligned)
            self.sampler.release(-1)

    @torch.inference_mode()
    def run_largest_batch(self, num_tokens: int, num_seqs: int, max_len: int) -> tuple[int, int, int]:
        """Run the largest iteration the scheduler can make, once, on all SMs: ``num_seqs``
        prompts of ``num_tokens`` tokens in all, split as evenly as they go (each prompt at least
        one token, so at most ``num_tokens`` prompts, and at most ``max_len`` tokens, the longest
        context, so at most ``num_seqs * max_len`` tokens), every one sampled through the torch
        path (``top_k`` 50 and ``top_p`` 0.9: float32 sorts of its logits, the sampler's largest
        buffers). Where split-level decode graphs exist (duet, pdmux), the sampling runs while a
        buffer as large as the forward's peak is held: a split's decode steps sample beside the
        prefill's live activations on the other stream. Every K/V goes to the scratch block;
        nothing else in the cache changes, and the sampler's default generator is left as it
        was. Its activations and logits are what a serving iteration allocates beyond the
        weights, the KV cache and the graphs' pools, so running it at start-up turns a cache
        that leaves too little memory into an error before any request, instead of failed
        requests mid-serving (vLLM sizes its cache after a profile run of the same batch).
        It resets CUDA's peak-memory statistics.

        Attention's own buffers are those of a batch without cached context or decodes: for
        the Triton and flash-attn backends they do not grow with context, while the torch
        reference backend's gathers of the cached keys do and are not covered.

        Returns:
            (tokens, prompts) the pass ran, and the peak bytes it allocated beyond what was
            allocated before it (CUDA; 0 elsewhere).

        Raises:
            torch.OutOfMemoryError: the device had not the memory for it.
        """
        n = max(1, min(num_seqs, num_tokens))
        total = min(num_tokens, n * max_len)
        lens = [total // n + 1] * (total % n) + [total // n] * (n - total % n)
        block = self.scratch_slot // self.block_size
        # seeded: the race kernel's seeds are drawn from no RNG (the default generator's draw is undone below)
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=0)
        batch = []
        for i, q in enumerate(lens):
            table = [block] * -(-q // self.block_size)
            seq = Sequence(-1 - i, [0] * q, q, params, block_table=table, block_array=np.asarray(table, np.int32))
            batch.append(ScheduledSeq(seq, q, 0))
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        state = self.sampler.default_generator.get_state()  # unseeded requests draw as if it had not run
        try:
            inputs = self._prepare(batch, 0, [None] * n)
            hidden = self._forward(inputs)
            held = None
            if cuda and self.split_graphs:  # a split samples decode steps while its prefill's activations live
                torch.cuda.synchronize(self.device)
                held = torch.empty(torch.cuda.max_memory_allocated(self.device) - before, dtype=torch.uint8,
                                   device=self.device)
            self._head(hidden, inputs)
            del held
            if cuda:
                torch.cuda.synchronize(self.device)
        finally:
            self.sampler.default_generator.set_state(state)
            for s in batch:
                self.sampler.release(s.seq.seq_id)
        return total, n, torch.cuda.max_memory_allocated(self.device) - before if cuda else 0

    def execute(self, out: SchedulerOutput) -> Iterator[Sampled]:
        """Launch ``out`` and return an iterator over its sampled tokens, part by part. A
        temporal plan gives one part with every token; a plan with ``k`` decode steps gives one
        part per step run, each as soon as that step has finished on the device, then the
        prefill's part. ``prefill_done`` and ``last_stream_seconds`` are set once the iterator
        is exhausted (for a temporal plan, only the GPU span on CUDA: ``_run_temporal``)."""
        self.prefill_done = True
        self.last_stream_seconds = {}
        self.last_launch_at = None
        if out.plan.prefill_layers is None:
            self._split = None  # no layer-split batch is pinned any more (finished, aborted or preempted)
        if self._unjoined is not None and (self._split is None or self._split[0] != _split_key(out)):
            # A dropped or changed split's last layers may still run, writing KV blocks that the
            # scheduler has since freed and may have handed out: wait for them first.
            torch.cuda.current_stream().wait_stream(self._unjoined)
            self._unjoined = None
        if out.plan.spatial or out.plan.k != 1 or out.plan.prefill_layers is not None:
            return self._execute_spatial(out)
        return iter([self._run_temporal(out)])

    @torch.inference_mode()
    def _run_temporal(self, out: SchedulerOutput) -> Sampled:
        """The whole batch on the current stream; on CUDA ``last_stream_seconds["gpu"]`` is the
        GPU's span from the forward's first kernel to the sampler's last (CUDA events, read after
        the token copy's sync), so the iteration's wall time less it is host time with the GPU
        idle (scheduling, inputs, the token read, outputs)."""
        batch = out.decodes + out.prefills
        inputs = self._prepare(batch, len(out.decodes), [None] * len(batch))
        if inputs is None:
            return Sampled({}, prefills=True)
        timers = _StreamTimers(self.device.type == "cuda")
        timers.mark("gpu")
        tokens = self._sample(inputs, self.graphs)
        timers.mark("gpu")
        sampled = Sampled(dict(zip(inputs.sample_seq_ids, tokens.tolist())), prefills=True)
        self.last_stream_seconds = timers.elapsed(("gpu",))
        return sampled

    def _execute_spatial(self, out: SchedulerOutput) -> Iterator[Sampled]:
        """Decode steps on the decode stream beside the prefill on the prefill stream.

        Step 0 (and step 1, when the prefill is predicted to outlast a step) are launched first,
        then the prefill, a layer at a time: between layers, each step already complete is handed
        out (serving Azure code on the H200, the launch of an eager prefill took the host 39 ms at
        the median, longer than a 27 ms step; handed out after it, a split's first token came
        with its second, a gap of two steps). Each later step takes the previous step's
        tokens on the device, and each step's tokens are handed out when it completes. Beside a
        prefill on SM-partitioned streams the next step is launched as soon as the previous one
        has completed (before its tokens are handed out) and only while the prefill is still
        running with at least half a step of it left (``_prefill_leaves_a_step``; at most
        ``plan.k``, the steps whose KV slots the scheduler reserved): decode neither idles long
        behind a prefill that runs longer than predicted nor holds up the next iteration, and
        the prefill's SMs, for most of a step when it runs shorter, at the cost of a short host
        gap between steps; a step may still start just after the prefill ended (the check and
        the launch are not atomic).
        A decode-only plan (multi-step decode) keeps the next step queued behind the running one
        (its inputs built while the GPU works) and stops starting steps once ``interrupt()``
        says new work waits; otherwise all ``plan.k`` steps run.
        """
        run, joined = None, None
        try:
            run = self._launch_spatial(out)
            for _ in self._launch_prefill(run):  # between layers: a step done meanwhile, or the next one
                if run.inflight and run.inflight[0].ready():
                    yield self._hand_out(run)
                elif not run.inflight:
                    self._launch_next_step(run, wait=False)
            if out.prefills:
                self.last_launch_at = time.perf_counter()
            while True:
                self._launch_next_step(run)
                if not run.inflight:
                    break
                yield self._hand_out(run)  # waits for that step
            joined = self._join(run)
            tokens = run.prefill_copy.tolist() if run.prefill_copy is not None else []
            self.last_stream_seconds = run.timers.elapsed(joined)
            if "prefill" in self.last_stream_seconds and (tail := run.timers.end_gap("decode", "prefill")) is not None:
                self.last_stream_seconds["tail"] = max(0.0, tail)  # the decodes' wait for the prefill's end
            yield Sampled(dict(zip(run.prefill_ids, tokens)), prefills=self.prefill_done)
        finally:
            if joined is None:  # abandoned (an error here or in the caller): nothing may outrun it
                self._split, self._unjoined = None, None
                try:
                    for stream in (run.decode_stream, run.prefill_stream) if run is not None else ():
                        if stream is not None:
                            run.main.wait_stream(stream)
                except RuntimeError:  # a sticky CUDA error: the original exception says more
                    log.exception("could not join the streams of an abandoned iteration")

    def _hand_out(self, run: _SpatialRun) -> Sampled:
        """The oldest step in flight's tokens (waits for them); the next step is queued first,
        if due, before the caller handles these, except in a multi-step decode on a CPU
        (``_runs_as_launched``), where the tokens would wait for that step to run."""
        tokens = run.inflight.popleft().tolist()
        if not self._runs_as_launched(run):
            self._launch_next_step(run, wait=False)
        return Sampled(dict(zip(run.decode_ids, tokens)), prefills=False, final=False)

    @torch.inference_mode()
    def _launch_spatial(self, out: SchedulerOutput) -> _SpatialRun:
        """Queue decode step 0, and step 1 too when the prefill is predicted to outlast a step
        (so the decode stream does not wait for the host between them); returns the run's
        state, the prefill not yet launched (``_launch_prefill``)."""
        decode_stream, prefill_stream = self._streams(out.plan)
        main = torch.cuda.current_stream() if self.device.type == "cuda" else None
        run = _SpatialRun(out, decode_stream, prefill_stream, main, _StreamTimers(main is not None),
                          self.split_graphs.get(out.plan.s_decode) if decode_stream is not None else self.graphs,
                          tables=[s.seq.block_ids.copy() for s in out.decodes],
                          partitioned=prefill_stream is not None and bool(out.prefills))
        for stream in (decode_stream, prefill_stream):
            if stream is not None:
                stream.wait_stream(main)
        if out.decodes:
            with _on(decode_stream):
                run.timers.mark("decode")
            self._launch_next_step(run)
            t_d, t_p = out.plan.predicted_decode_s, out.plan.predicted_prefill_s
            if out.prefills and t_d is not None and t_p is not None and executed_steps(t_d, t_p) > 1:
                self._launch_next_step(run)  # step 1 queued too: the prefill's launch takes the host a while
        return run

    @torch.inference_mode()
    def _launch_prefill(self, run: _SpatialRun) -> Iterator[None]:
        """Queue the prefill on its stream; beside decodes on a partitioned stream, pause
        (``yield``, outside the stream's context) between the decoder layers of an eager
        prefill. Sets ``prefill_copy``, ``prefill_ids`` and, on a partitioned stream,
        ``prefill_end``. A layer-split round (``plan.prefill_layers``) is queued whole."""
        out = run.out
        if out.plan.predicted_prefill_s is not None:
            run.prefill_due = time.perf_counter() + out.plan.predicted_prefill_s  # it includes the launch
        run.prefill_begun = True
        with _on(run.prefill_stream):
            run.timers.mark("prefill")
            if out.plan.prefill_layers is not None and out.prefills:
                prefill, run.prefill_copy = self._prefill_layers(out)
            else:
                prefill = self._prepare(out.prefills, 0, [None] * len(out.prefills)) if out.prefills else None
        if prefill is not None and out.plan.prefill_layers is None:
            state = None
            for layer in range(self.model.dims.num_layers):
                if layer and run.partitioned and out.decodes:
                    yield
                with _on(run.prefill_stream):
                    state = self.model.run_layers(state, prefill.input_ids, prefill.positions, self.kv_caches,
                                                  prefill.meta, layer, layer + 1)
            with _on(run.prefill_stream):
                run.prefill_copy = _HostCopy(self._head(self.model.final_norm(state), prefill))
        run.prefill_ids = prefill.sample_seq_ids if prefill else []
        with _on(run.prefill_stream):
            run.timers.mark("prefill")
            if run.partitioned:
                run.prefill_end = self._prefill_end_event()

    @staticmethod
    def _prefill_end_event() -> torch.cuda.Event:
        """An event recorded on the current stream after the prefill's last kernel."""
        event = torch.cuda.Event()
        event.record()
        return event

    def _runs_as_launched(self, run: _SpatialRun) -> bool:
        """A decode-only plan (multi-step decode) off CUDA: each step runs to its end as it is
        launched, so one queued ahead would hold back the previous step's tokens (clients got
        them in bursts: two or three tokens at once, then a gap of three steps)."""
        return self.device.type != "cuda" and not run.out.prefills

    @torch.inference_mode()
    def _launch_next_step(self, run: _SpatialRun, wait: bool = True) -> None:
        """Queue the next decode step if one is due: fewer than ``plan.k`` launched, and either
        the prefill still running beside it on a partitioned stream (then only after the
        previous step completed, and see ``_prefill_leaves_a_step``), or, for a decode-only plan
        (multi-step decode), no ``interrupt`` and fewer than two in flight (one off CUDA).
        ``wait=False``: leave a step that would have to wait for the prefill unlaunched (decided at
        the next call). Before the prefill's launch begins (``_launch_spatial``), two steps may be
        queued."""
        out = run.out
        in_flight = 1 if run.beside_prefill or self._runs_as_launched(run) else 2
        if len(run.inflight) >= in_flight or run.launched >= out.plan.k or not out.decodes:
            return
        if run.launched > 0 and (not self._prefill_leaves_a_step(run, wait) if run.beside_prefill else
                                 not out.prefills and self.interrupt is not None and self.interrupt()):
            return
        with _on(run.decode_stream):  # inputs uploaded on the stream that reads them
            step = self._prepare(out.decodes, len(out.decodes), [run.launched] * len(out.decodes), run.tables,
                                 run.sampling)
            run.sampling = step.sampling  # built once: a request finished mid-iteration keeps no generator
            if run.ids is not None:
                step.input_ids = run.ids  # the previous step's tokens, still on the device
            run.ids = self._sample(step, run.graphs)
            run.inflight.append(_HostCopy(run.ids))
            run.timers.mark_end("decode")  # the decode stream's busy time ends with its last step
        run.decode_ids = step.sample_seq_ids
        run.launched += 1

    @staticmethod
    def _prefill_leaves_a_step(run: _SpatialRun, wait: bool) -> bool:
        """Whether a decode step should start beside the prefill (``optimizer.executed_steps``):
        never once the prefill has ended; yes while at least ``STEP_START_SHARE`` of a predicted
        decode step ``t_d`` is left until the prefill's predicted end (``prefill_due``). With
        less left the decodes hold (polling) for the prefill to end, and no step starts; if it
        has not ended ``STEP_START_SHARE t_d`` after the hold began (it outran its prediction),
        a step starts then. ``wait=False`` answers False instead of holding. Without
        predictions: a step starts while the prefill runs. A prefill still being launched
        (``prefill_end`` not yet recorded) is running, and no hold begins before its launch
        has ended."""
        t_d = run.out.plan.predicted_decode_s
        while run.prefill_end is None or not run.prefill_end.query():
            if run.prefill_due is None or not t_d:
                return True
            now = time.perf_counter()
            if run.prefill_due - now >= STEP_START_SHARE * t_d:
                return True
            if run.prefill_end is None:
                return False
            if run.hold_until is None:
                run.hold_until = now + STEP_START_SHARE * t_d
            if now >= run.hold_until:
                return True
            if not wait:
                return False
            time.sleep(min(run.hold_until - now, _POLL_S))
        return False

    def _join(self, run: _SpatialRun) -> tuple[str, ...]:
        """Make the main stream wait for the streams whose work is complete; returns their
        names. A layer-split prefill with layers left keeps running on its stream and nothing
        waits for it (SGLang's pdmux syncs only the decode stream each round; later rounds
        queue behind it on the same stream)."""
        joined = ("decode", "prefill") if self.prefill_done else ("decode",)
        self._unjoined = None if self.prefill_done else run.prefill_stream
        for name, stream in (("decode", run.decode_stream), ("prefill", run.prefill_stream)):
            if stream is not None and name in joined:
                run.main.wait_stream(stream)
        return joined

    def _prefill_layers(self, out: SchedulerOutput) -> tuple[StepInputs, _HostCopy | None]:
        """One round of a layer-split prefill (SGLang pdmux): the next ``plan.prefill_layers``
        layers of the pinned batch (its inputs uploaded in its first round) are queued on the
        prefill stream; the round that queues the last layer also queues the sampling and a
        copy of its tokens to the host. Returns the batch's inputs and, in the first later round
        that finds that copy landed, the copy (None before; ``prefill_done`` says which); a
        round without decodes delivers it at once (it joins the prefill stream, nothing waits).

        No round with decodes waits for the prefill stream: one that joined it when the last
        layer was queued waited for every layer queued before (1.0-1.7 s with 32k-token
        prompts on the H200, stalling every decode)."""
        key = _split_key(out)
        if self._split is None or self._split[0] != key:  # a new batch (or a preempted one, restarted)
            self._split = (key, self._prepare(out.prefills, 0, [None] * len(out.prefills)), None, 0, None)
        _, inputs, state, start, sampled = self._split
        layers = self.model.dims.num_layers
        if start < layers:
            end = min(layers, start + out.plan.prefill_layers)
            state = self.model.run_layers(state, inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                          start, end)
            if end == layers:
                sampled, state = _HostCopy(self._head(self.model.final_norm(state), inputs)), None
            self._split = (key, inputs, state, end, sampled)
        if sampled is None or (out.decodes and not sampled.ready()):  # alone, a round may wait for it
            self.prefill_done = False
            return inputs, None
        self._split = None
        return inputs, sampled

    def _streams(self, plan) -> tuple[torch.cuda.Stream | None, torch.cuda.Stream | None]:
        """The plan's (decode, prefill) streams, or (None, None) to run both on the current one."""
        if not plan.spatial or self.partition is None or self.partition.granularity == 0 or self.device.type != "cuda":
            return None, None
        pair = self.partition.pair(plan.s_decode)
        return pair.decode, pair.prefill

    def _prepare(self, batch: list[ScheduledSeq], num_decodes: int, ahead: list[int | None],
                 block_tables: list[np.ndarray] | None = None, sampling: SamplingBatch | None = None
                 ) -> StepInputs | None:
        """Inputs for ``batch``; ``ahead[i] = j`` makes decode ``i`` run its look-ahead step ``j``
        (position ``c + j``; its input token is filled in from step ``j - 1`` on the device).
        ``block_tables``: the sequences' tables (int32 arrays) as scheduled (a look-ahead step
        is built after earlier steps' tokens were applied, when a finished sequence has given
        its blocks back); ``sampling``: the batch's sampling parameters if already uploaded.
        Block tables, positions and slot mappings are built with numpy, a fixed number of array
        operations per batch: a long sequence has thousands of blocks, and walking them in
        Python cost milliseconds of host time per step."""
        if not batch:
            return None
        block_tables = block_tables if block_tables is not None else [s.seq.block_ids for s in batch]
        ids, cached, parked, qlens, ctxs, sample_rows, sample_seqs = [], [], [], [], [], [], []
        for s, j in zip(batch, ahead):
            parked.append(j is not None and j >= s.max_steps)  # no token left to make: recompute the last step
            c = s.num_cached_tokens + (min(j, s.max_steps - 1) if j is not None else 0)
            q = s.num_new_tokens
            ids.extend(s.seq.token_ids[c:c + q] if j is None else s.seq.token_ids[-1:])
            cached.append(c)
            qlens.append(q)
            ctxs.append(c + q)
            if j is not None or s.samples:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(s.seq)
        widths = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
        tables = np.zeros((len(batch), widths.max()), dtype=np.int32)
        tables[np.arange(tables.shape[1]) < widths[:, None]] = np.concatenate(block_tables)  # rows left-aligned
        starts = np.concatenate(([0], np.cumsum(qlens)))
        owner = np.repeat(np.arange(len(batch)), qlens)  # the sequence of each query token
        positions = np.arange(starts[-1]) - starts[owner] + np.asarray(cached)[owner]
        slots = tables[owner, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        slots[np.asarray(parked)[owner]] = self.scratch_slot
        rows = None if len(sample_rows) == len(ids) else sample_rows
        ids_t, pos_t, slots_t, rows_t = upload([ids, positions, slots, rows or []], torch.int64, self.device)
        starts_t, ctxs_t, tables_t = upload([starts, ctxs, tables.reshape(-1)], torch.int32, self.device)
        meta = AttentionMetadata(slot_mapping=slots_t, query_start_loc=starts_t, context_lens=ctxs_t,
                                 block_tables=tables_t.view(tables.shape), num_decodes=num_decodes,
                                 query_lens_cpu=qlens, context_lens_cpu=ctxs, split_counters=self.split_counters)
        if sampling is None:
            sampling = self.sampler.prepare([s.seq_id for s in sample_seqs], [s.params for s in sample_seqs],
                                            self.model.dims.vocab_size)
        return StepInputs(ids_t, pos_t, meta, None if rows is None else rows_t, [s.seq_id for s in sample_seqs],
                          sampling)

    def _sample(self, inputs: StepInputs, graphs: DecodeGraphs | None) -> torch.Tensor:
        """Forward pass (writes the K/V) and sampling; returns the sampled tokens ``[n]`` on the device
        (empty when no row samples, e.g. a prefill chunk in the middle of its prompt). Decode-only
        batches replay ``graphs`` where a bucket holds them; batches with prefill tokens (temporal
        plans only: ``piecewise`` runs on all SMs) replay the piecewise graphs where one holds them."""
        n = inputs.input_ids.shape[0]
        decode_only = inputs.meta.num_decodes == n
        if decode_only and graphs is not None and graphs.bucket(n):
            return self.sampler.sample(graphs.run(inputs.input_ids, inputs.positions, inputs.meta), inputs.sampling,
                                       inputs.positions)
        return self._head(self._forward(inputs), inputs)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Final-normed hidden states ``[tokens, hidden]`` of a batch run on the current stream: from
        the piecewise graphs where it has prefill tokens and one holds it, else eagerly."""
        n = inputs.input_ids.shape[0]
        if inputs.meta.num_decodes < n and self.piecewise is not None and self.piecewise.bucket(n):
            return self.piecewise.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _head(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """Sampled tokens ``[n]`` (int64, on the device) from the final-normed hidden states
        ``[tokens, hidden]`` of the whole batch: its sampled rows, the LM head, the sampler."""
        positions = inputs.positions
        if inputs.sample_rows is not None:
            hidden = hidden.index_select(0, inputs.sample_rows)
            positions = positions.index_select(0, inputs.sample_rows) if inputs.sampling.race is not None else None
        return self.sampler.sample(self.model.compute_logits(hidden), inputs.sampling, positions)
