"""Calibration on a CUDA GPU: primitive rates on SM-restricted streams and iteration latencies
of the engine's model runner (the code the server runs). METHOD of the device notes: CUDA
events, warm-up, median of repeats, random inputs (never zeros) rotated past L2.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from duetserve.calibrate.profile import DeviceFacts
from duetserve.calibrate.workload import (
    DECODE_BATCHES,
    MAX_CONTEXT,
    PREFILLS,
    Capacity,
    Shape,
    make_batch,
    rotation_sets,
)
from duetserve.partition import make_partition_backend

BF16 = torch.bfloat16


@dataclass
class Primitive:
    """One benchmark kernel: ``run(i)`` launches it on input set ``i % sets``; each launch
    does ``work`` bytes (copy, gemv) or FLOPs (gemm)."""

    run: Callable[[int], object]
    work: float


def copy_primitive(device: torch.device, numel: int = 1 << 28) -> Primitive:
    """bf16 tensor copy of ``numel`` elements; work = bytes read + written."""
    nbytes = 2 * 2 * numel
    bufs = [(torch.randn(numel, dtype=BF16, device=device), torch.empty(numel, dtype=BF16, device=device))
            for _ in range(rotation_sets(nbytes))]
    return Primitive(lambda i: bufs[i % len(bufs)][1].copy_(bufs[i % len(bufs)][0]), nbytes)


def gemv_primitive(device: torch.device, m: int = 32, k: int = 4096, n: int = 28672) -> Primitive:
    """Decode-shaped bf16 ``[m,k] x [k,n]``; work = weight bytes."""
    out = torch.empty(m, n, dtype=BF16, device=device)
    bufs = [(torch.randn(m, k, dtype=BF16, device=device), torch.randn(k, n, dtype=BF16, device=device))
            for _ in range(rotation_sets(2 * k * n))]
    return Primitive(lambda i: torch.mm(*bufs[i % len(bufs)], out=out), 2 * k * n)


def gemm_primitive(device: torch.device, size: int = 8192) -> Primitive:
    """bf16 ``size^3`` matrix product; work = 2 size^3 FLOPs."""
    out = torch.empty(size, size, dtype=BF16, device=device)
    bufs = [(torch.randn(size, size, dtype=BF16, device=device), torch.randn(size, size, dtype=BF16, device=device))
            for _ in range(rotation_sets(2 * 2 * size * size))]
    return Primitive(lambda i: torch.mm(*bufs[i % len(bufs)], out=out), 2.0 * size ** 3)


PRIMITIVE_FACTORIES = {"copy": copy_primitive, "gemv": gemv_primitive, "gemm": gemm_primitive}


def time_on_stream(run: Callable[[int], object], stream, warmup: int, repeats: int) -> float:
    """Median seconds of ``run(i)`` on ``stream``, a pair of CUDA events around each call,
    after ``warmup`` untimed calls."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    with torch.cuda.stream(stream):
        for i in range(warmup):
            run(i)
        for i, (start, end) in enumerate(events):
            start.record()
            run(warmup + i)
            end.record()
    events[-1][1].synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def median_wall_seconds(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median host seconds of ``fn()`` (which must end in a host sync) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class CudaBench:
    """``runner.Bench`` on a CUDA device.

    Args:
        partition: ``greenctx``, ``tpcmask`` or ``none`` (``make_partition_backend``; a backend
            that fails its self-test falls back, and ``facts.note`` says why).
        device: ``cuda`` or ``cuda:N``.
        repeats: timed repeats per measurement (warm-up: a quarter of it, at least 2).
        attention_backend: the engine's attention backend (``EngineConfig``).

    Raises (constructor):
        RuntimeError: no CUDA device.
    """

    def __init__(self, partition: str = "greenctx", device: str = "cuda", repeats: int = 20,
                 attention_backend: str = "auto"):
        if not torch.cuda.is_available():
            raise RuntimeError("calibrate needs a CUDA GPU and none is visible")
        self.device = torch.device(device)
        self.repeats, self.warmup = repeats, max(2, repeats // 4)
        self.attention_backend = attention_backend
        self.backend = make_partition_backend(partition, self.device)
        props = torch.cuda.get_device_properties(self.device)
        levels = tuple(self.backend.levels()) if self.backend.granularity else ()
        note = getattr(self.backend, "reason", "") or getattr(self.backend, "fallback_reason", "")
        self.facts = DeviceFacts(props.name, props.multi_processor_count, props.major, props.total_memory,
                                 self.backend.name, levels, f"({note})" if note else "")
        self._primitives: dict[str, Primitive] = {}
        self.engine = None

    def _stream(self, sms: int):
        """The device's own stream for all SMs, else the decode stream of the backend's pair."""
        if sms == self.facts.num_sms:
            return torch.cuda.current_stream(self.device)
        pair = self.backend.pair(sms)
        if pair.s_decode != sms:
            raise RuntimeError(f"asked for {sms} SMs, the {self.backend.name} backend granted {pair.s_decode}")
        return pair.decode

    def primitive_rate(self, name: str, sms: int) -> float:
        """Bytes/s (copy, gemv) or FLOP/s (gemm) on ``sms`` SMs; inputs are built on first use."""
        if name not in self._primitives:
            self._primitives[name] = PRIMITIVE_FACTORIES[name](self.device)
        prim = self._primitives[name]
        return prim.work / time_on_stream(prim.run, self._stream(sms), self.warmup, self.repeats)

    def load_model(self, folder: Path, load_format: str) -> Capacity:
        """Build the engine (bf16, CUDA graphs, KV cache filled with random values) for ``folder``,
        on this bench's partition backend (decode graphs recorded per split level, as serve does;
        no piecewise graphs: prefill shapes measure the eager passes the cost model's launch term fits),
        with room for ``MAX_CONTEXT`` tokens a sequence or the model's own limit if smaller (the
        shapes beyond it are then skipped, ``Capacity.misfit``)."""
        from transformers import AutoConfig

        from duetserve.config import EngineConfig
        from duetserve.engine.engine import LLMEngine

        self._primitives.clear()
        torch.cuda.empty_cache()
        limit = getattr(AutoConfig.from_pretrained(str(folder)), "max_position_embeddings", None) or MAX_CONTEXT
        config = EngineConfig(model=str(folder), load_format=load_format, device=str(self.device), dtype="bfloat16",
                              max_num_seqs=max(DECODE_BATCHES),
                              max_num_batched_tokens=max(b * n for b, n in PREFILLS),
                              kv_cache_memory_fraction=0.75, max_model_len=min(MAX_CONTEXT, limit),
                              piecewise_cuda_graph_max_tokens=0, policy="duet",  # duet: split decode graphs
                              attention_backend=self.attention_backend, partition_backend=self.backend.name)
        self.engine = LLMEngine(config)
        for k, v in self.engine.runner.kv_caches:
            k.normal_()
            v.normal_()
        if self.backend.granularity:
            self.engine.runner.partition = self.backend
        return Capacity(self.facts.num_sms, self.engine.block_manager.num_blocks, config.block_size,
                        config.max_num_seqs, config.max_num_batched_tokens, self.engine.max_model_len)

    def runs_graphs(self, shape: Shape) -> bool:
        """Whether the engine replays ``shape``'s iterations from CUDA graphs: decode-only batches
        that fit a recorded bucket, on all SMs or on a split level with its own graphs."""
        runner = self.engine.runner
        graphs = runner.graphs if shape.sms == self.facts.num_sms else runner.split_graphs.get(shape.sms)
        return shape.kind == "decode" and graphs is not None and graphs.bucket(shape.batch) is not None

    def kernel_names(self, shape: Shape, replay: bool = False) -> list[str]:
        """Names of the GPU activities (kernels, memcpy, memset) of one iteration of ``shape`` on
        all SMs, from ``torch.profiler`` after one unprofiled warm-up run: run eagerly (about
        what a graph of more than ``narrow_decode_batch`` decodes records, plus the input
        copies), or with ``replay`` from the decode CUDA graphs."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        runner = self.engine.runner
        graphs = runner.graphs
        if not replay:
            runner.graphs = None
        try:
            with self._temporal(shape) as out:
                list(runner.execute(out))
                torch.cuda.synchronize(self.device)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    list(runner.execute(out))
                    torch.cuda.synchronize(self.device)
        finally:
            runner.graphs = graphs
        return [e.name for e in prof.events()
                if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]

    def narrow_decode_batch(self) -> int:
        """``triton_gemm.MAX_M`` (capped at the largest decode graph) where the decode graphs
        record the Triton decode GEMM (``layers.graph_kernels_enabled`` when recording: the
        ``DUETSERVE_DECODE_GEMM`` switch on ``triton`` and triton importable), else 0."""
        from duetserve.model import layers

        graphs = self.engine.runner.graphs
        gemm = layers._gemm_kernels()
        if graphs is None or gemm is None or layers.decode_gemm_mode() != "triton":
            return 0
        return min(gemm.MAX_M, graphs.buckets[-1])

    @contextlib.contextmanager
    def _temporal(self, shape: Shape, extra_tokens: int = 0):
        """A ``SchedulerOutput`` running ``shape`` as one temporal iteration on all SMs (a mixed
        shape's decodes and chunk together); its KV blocks (plus ``extra_tokens`` look-ahead slots
        per request) are freed on exit."""
        from duetserve.engine.policy import Plan
        from duetserve.engine.scheduler import SchedulerOutput

        engine = self.engine
        seqs = make_batch(engine, shape.batch, shape.q + shape.c, shape.q, extra_tokens)
        chunk = []
        try:
            if shape.chunk:  # a mixed shape's prefill chunk, numbered after the decodes
                chunk = make_batch(engine, 1, shape.chunk_cached + shape.chunk, shape.chunk,
                                   first_id=20_000_000)
            decodes, prefills = ([], seqs) if shape.kind == "prefill" else (seqs, chunk)
            yield SchedulerOutput(decodes, prefills, Plan(), [])
        finally:
            for s in seqs + chunk:
                engine.block_manager.free(s.seq)

    def iteration_seconds(self, shape: Shape) -> float:
        """Median seconds of ``runner.execute`` on ``shape``.

        ``shape.k == 1`` (prefill and mixed; all SMs): wall time of a temporal iteration, host
        sync included, as the engine loop sees it. Decode with ``shape.k`` steps: a multi-step
        decode on all SMs, or a spatial plan with no prefill on ``shape.sms``; the decode
        stream's event time over k (the GPU's time per step, the host's work on the next step
        hidden behind the one running, as in serving).

        Raises ValueError for a prefill or mixed shape on fewer than all SMs, or with ``k > 1``.
        """
        from duetserve.engine.policy import Plan
        from duetserve.engine.scheduler import SchedulerOutput

        runner = self.engine.runner
        n = self.facts.num_sms
        if shape.k == 1 and shape.sms == n:
            with self._temporal(shape) as out:
                return median_wall_seconds(lambda: list(runner.execute(out)), self.warmup, self.repeats)
        if shape.kind != "decode":
            raise ValueError("only decode is measured on fewer than all SMs or with k > 1")
        spatial = shape.sms < n
        plan = Plan(spatial=spatial, s_prefill=n - shape.sms if spatial else 0, s_decode=shape.sms, k=shape.k)
        with self._temporal(shape, shape.k - 1) as temporal:
            out = SchedulerOutput(temporal.decodes, [], plan, [])
            list(runner.execute(out))
            steps = []
            for _ in range(max(3, self.repeats // 4)):
                list(runner.execute(out))
                steps.append(runner.last_stream_seconds["decode"] / shape.k)
            return statistics.median(steps)
