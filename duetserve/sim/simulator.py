"""Trace simulator: the engine's scheduler and policies, with the cost model as the clock.

A trace is replayed through the same ``Scheduler`` the engine runs (docs/design.md section 2: one
scheduler, two executors); this module is the second executor. It runs no model: every
iteration lasts what the roofline cost model (docs/design.md section 3) predicts for its batch on the
profile's GPU, and sampled tokens are a fake id that is never EOS, so a request ends after
exactly its trace output length (``max_tokens``).

Iteration time, by plan:

* temporal: ``t_mixed(S)``, the whole batch on all SMs; every token comes at the end;
* multi-step decode (``SimConfig.decode_steps``, ``serve --num-decode-steps``): a decode-only
  iteration of ``k`` steps takes the decodes' host time ``h`` once, then steps of the GPU time
  ``g`` back to back (``CostModel.predict_steps``), token ``i`` at ``h + i g``. As the engine's
  interrupt does, no step after the first starts once a request has arrived: step ``j >= 2`` starts
  when step ``j - 2`` ends (two in flight), at ``h + (j - 1) g``, step 1 with step 0; nor once
  a decode's end has made room for a waiting request (``_room_steps``);
* spatial (duet): after the decodes' host time ``h = R host_per_request_s`` (the inputs of
  the first step, ``duetserve.planner.optimizer``), decode runs steps of ``t_d(S_d)`` beside
  the prefill batch's ``t_p(S_p)`` (both with the profile's interference factors,
  ``CostModel.predict_spatial``) while the prefill runs, as the executor does: ``n =
  executed_steps(t_d, t_p, k)`` steps; the iteration lasts ``h + max(n t_d, t_p)``; decode
  token ``i`` comes at ``h + i t_d``, the prefill's first tokens at the end;
* layer-split prefill (pdmux): the prefill batch's time on its SMs is spread evenly over the
  model's layers. Each round submits ``plan.prefill_layers`` more layers to the prefill
  stream, which runs them back to back; the round itself lasts one decode step ``t_d(S_d)``
  (SGLang syncs only the decode stream), or, with no decode, until the submitted layers are
  done. Beside decodes the prefill completes at the end of the first round that starts after
  its last layer finished (the engine checks, without waiting, as a round starts); alone, at
  the end of the round that ran its last layer.

While work is left, the next iteration starts the profile's ``gap_s`` (``host_gap_s`` plus
``host_gap_per_request_s`` per request of the iteration before) after the last one ends: the
server's host time between iterations, which no prediction prices (``StepStats.gap_s``).

With ``SimConfig.prediction_error`` sigma > 0 each of those times is the prediction times a
lognormal factor ``exp(N(0, sigma^2))`` (median 1; a spatial iteration draws one for ``t_d`` and
one for ``t_p``), seeded: the GPU runs iterations off their prediction (docs/benchmarks.md,
thirteenth H200 session: temporal ones 0.93-1.0x at the median, about 1.15x at p99, which
sigma 0.05 approximates), and the policies' feedback sees that error: each temporal iteration
with decodes and prefill (``observe_iteration``, ``--trim-margin auto``), and each split's
decode step and prefill times (``observe``: duet's decode correction and prefill scale), as the
engine reports them.

With ``SimConfig.clock_profile`` the iterations take that profile's predictions while the
policies plan with the planner's: a profile that is wrong about the GPU in a known way (say a
``decode_interference`` 1.3x too low) replays what biased predictions do to the policies'
feedback, which a centred ``prediction_error`` cannot (docs/benchmarks.md, fourteenth H200
session: a decode correction that fell to its floor on the GPU and passed the simulation).

A request's TTFT runs from its arrival to its first token, its TBT gaps between consecutive
tokens (a preempted request's gap includes its recompute). KV capacity is the profile's HBM
times a utilization, minus the weights, divided by the KV bytes per token (vLLM's sizing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from duetserve.bench.client import RequestRecord
from duetserve.config import CUDA_TOKEN_BUDGET, EngineConfig
from duetserve.engine.kv_cache import BlockManager
from duetserve.engine.policy import Policy
from duetserve.engine.scheduler import MAX_LOOKAHEAD, ScheduledSeq, Scheduler, SchedulerOutput
from duetserve.engine.sequence import Sequence as Seq
from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import HardwareProfile
from duetserve.planner.optimizer import executed_steps
from duetserve.planner.policies import PlannerConfig
from duetserve.sampling import SamplingParams
from duetserve.traces import TraceRequest

FAKE_TOKEN = 1
"""The id every simulated sample returns; simulated sequences have no EOS id."""


def weight_bytes(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """Bytes of the model's weights: embeddings, lm_head unless tied, and per layer the q/k/v,
    o, gate/up, down projections and two RMSNorms, plus the final norm."""
    attn = shape.hidden * (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim + shape.q_heads * shape.head_dim * shape.hidden
    layer = attn + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    embed = shape.vocab * shape.hidden * (1 if shape.tie_embeddings else 2)
    return dtype_bytes * (shape.layers * layer + embed + shape.hidden)


def kv_cache_tokens(shape: ModelShape, profile: HardwareProfile, utilization: float = 0.9, dtype_bytes: int = 2,
                    tp: int = 1) -> int:
    """Tokens of KV cache one GPU holds: ``(hbm_bytes * utilization - weights / tp)`` divided by
    ``layers * 2 * kv_heads / tp * head_dim * dtype_bytes`` bytes per token (KV heads
    replicated when fewer than ``tp``).

    Raises:
        ValueError: ``utilization`` outside (0, 1], or the weights leave no room for KV.
    """
    if not 0 < utilization <= 1:
        raise ValueError("the memory utilization must be in (0, 1]")
    free = profile.hbm_bytes * utilization - weight_bytes(shape, dtype_bytes) / tp
    per_token = shape.layers * 2 * max(1, shape.kv_heads // tp) * shape.head_dim * dtype_bytes
    if free < per_token:
        raise ValueError(f"{profile.name}: the weights of the model leave no memory for the KV cache")
    return int(free // per_token)


@dataclass(frozen=True)
class SimConfig:
    """Settings of one simulation.

    Attributes:
        planner: model shape, GPU profile, TBT SLO and partition backend; its cost model is
            the simulated GPU's clock.
        max_num_seqs: most running sequences (default: serve's, ``EngineConfig.max_num_seqs``,
            so the simulation predicts the server as launched: when they differed, serve 64 and
            the simulator 256, it put duet 19% above the H200 on Azure conv at QPS 20,
            docs/benchmarks.md, twenty-seventh session).
        max_num_batched_tokens: token budget per iteration (serve's default on CUDA,
            ``CUDA_TOKEN_BUDGET``).
        block_size: tokens per KV block.
        kv_cache_tokens: KV capacity in tokens; None sizes it from the profile's HBM
            (``kv_cache_tokens``) at ``gpu_memory_utilization``.
        gpu_memory_utilization: share of HBM for weights and KV cache, (0, 1].
        max_model_len: context limit in tokens; None takes the model's (``ModelShape.max_positions``,
            as ``serve`` does), or where that is unknown fits the trace's longest request. A
            request whose prompt and output exceed it fails, as ``serve`` refuses it.
        prediction_error: sigma of the lognormal factor on every simulated time (module
            docstring); 0 runs the predictions exactly.
        seed: seed of those factors.
        clock_profile: the profile whose predictions the simulated iterations take (module
            docstring); None: the planner's.
        decode_steps: decode-only iterations run up to this many steps (module docstring; serve's
            default, 8); 1: off.

    Raises:
        ValueError: ``prediction_error`` outside [0, 1], a ``clock_profile`` with another SM
            count than the planner's profile, or ``decode_steps`` outside [1, ``MAX_LOOKAHEAD``].
    """

    planner: PlannerConfig
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = CUDA_TOKEN_BUDGET
    block_size: int = 16
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    prediction_error: float = 0.0
    seed: int = 0
    clock_profile: HardwareProfile | None = None
    decode_steps: int = 8

    def __post_init__(self) -> None:
        if not 0.0 <= self.prediction_error <= 1.0:
            raise ValueError(f"prediction_error must be a sigma in [0, 1], got {self.prediction_error}")
        if not 1 <= self.decode_steps <= MAX_LOOKAHEAD:
            raise ValueError(f"decode_steps must be in [1, {MAX_LOOKAHEAD}], got {self.decode_steps}")
        clock, planned = self.clock_profile, self.planner.profile
        if clock is not None and clock.num_sms != planned.num_sms:
            raise ValueError(f"the clock profile {clock.name!r} has {clock.num_sms} SMs, the planner's "
                             f"{planned.name!r} {planned.num_sms}")

    def kv_blocks(self) -> int:
        """KV-cache blocks of ``block_size`` tokens (raises ValueError as ``kv_cache_tokens``)."""
        p = self.planner
        tokens = self.kv_cache_tokens or kv_cache_tokens(p.shape, p.profile, self.gpu_memory_utilization, tp=p.tp)
        return tokens // self.block_size


@dataclass(slots=True)
class IterationRecord:
    """One simulated iteration: start and length in seconds, the plan's kind, partition and
    predicted seconds (None when the policy predicts nothing), and the batch."""

    start_s: float
    duration_s: float
    predicted_s: float | None
    spatial: bool
    slo_risk: bool
    s_decode: int
    k: int
    num_decodes: int
    num_prefill_tokens: int


@dataclass
class SimResult:
    """Outcome of one simulation.

    Attributes:
        policy: policy name.
        records: one per trace request, in trace order (times relative to its arrival,
            ``start_s == arrival_s``); a request that cannot run has ``error`` set.
        iterations: every iteration, in order.
        duration_s: from the first arrival (0) to the last token, seconds.
        num_preemptions: sequences preempted (recomputed).
        kv_cache_tokens: KV-cache capacity simulated, tokens (whole blocks).
        wall_s: host seconds the simulation took.
    """

    policy: str
    records: list[RequestRecord]
    iterations: list[IterationRecord]
    duration_s: float
    num_preemptions: int
    kv_cache_tokens: int
    wall_s: float


@dataclass
class _LayerSplit:
    """The prefill stream of a layer-split prefill batch in flight."""

    batch: list[ScheduledSeq]  # the batch as first scheduled (the scheduler hands out these objects)
    layer_s: float  # seconds per layer of the batch on its SMs
    layers_left: int  # layers not yet submitted
    busy_until_s: float  # when the layers submitted so far are done

    def holds(self, prefills: list[ScheduledSeq]) -> bool:
        """Whether ``prefills`` is (what preemption left of) this batch."""
        return any(prefills[0] is s for s in self.batch)


def _reqs(batch: list[ScheduledSeq]) -> list[tuple[int, int]]:
    return [(s.num_new_tokens, s.num_cached_tokens) for s in batch]


class _Run:
    """State of one simulation: scheduler, clock, and per-request token times."""

    def __init__(self, trace: Sequence[TraceRequest], policy: Policy, config: SimConfig) -> None:
        self.trace, self.config = trace, config
        p, clock = config.planner, config.clock_profile  # the clock: what iterations take
        self.cm = p.cost_model if clock is None else CostModel(p.shape, clock, tp=p.tp, cuda_graphs=p.cuda_graphs,
                                                               piecewise_tokens=p.piecewise_tokens)
        self.total_sms = config.planner.profile.num_sms
        max_len = config.max_model_len or config.planner.shape.max_positions or \
            max((r.input_len + r.output_len for r in trace), default=2)
        self.blocks = BlockManager(config.kv_blocks(), config.block_size)
        self.scheduler = Scheduler(policy, self.blocks, config.max_num_seqs, config.max_num_batched_tokens, max_len,
                                   decode_steps=config.decode_steps)
        self.records = [RequestRecord(i, r.input_len, r.output_len, r.arrival_s, r.arrival_s)
                        for i, r in enumerate(trace)]
        self.iterations: list[IterationRecord] = []
        self.split: _LayerSplit | None = None
        self.now = 0.0
        self.rng = np.random.default_rng(config.seed)

    def _actual(self, predicted_s: float) -> float:
        """The simulated seconds of a step predicted at ``predicted_s`` (``prediction_error``)."""
        sigma = self.config.prediction_error
        return predicted_s * math.exp(self.rng.normal(0.0, sigma)) if sigma else predicted_s

    def _spatial(self, decode: list[tuple[int, int]], prefill: list[tuple[int, int]], s_decode: int) -> tuple[float, float]:
        """Simulated ``(t_d, t_p)`` of a split with ``s_decode`` SMs for decode."""
        t_d, t_p = self.cm.predict_spatial(decode, prefill, s_decode, self.total_sms)
        return self._actual(float(t_d)), self._actual(float(t_p))

    def add(self, index: int) -> bool:
        """Queue trace request ``index``; False (and the record's ``error`` set) when it can
        never run, or when ``serve`` would refuse it: prompt and output beyond the context limit
        (``LLMEngine.check_request``; the scheduler alone would cut the output there)."""
        req, rec = self.trace[index], self.records[index]
        if req.input_len + req.output_len > self.scheduler.max_model_len:
            rec.error = (f"max_tokens={req.output_len} plus the {req.input_len}-token prompt exceeds the "
                         f"maximum context length of {self.scheduler.max_model_len} tokens")
            return False
        need = -(-(req.input_len + req.output_len) // self.blocks.block_size)
        if need > self.blocks.num_blocks:
            rec.error = f"needs {need} KV blocks; the cache has {self.blocks.num_blocks}"
            return False
        seq = Seq(index, [FAKE_TOKEN] * req.input_len, req.input_len,
                  SamplingParams(max_tokens=req.output_len, ignore_eos=True), req.arrival_s)
        try:
            self.scheduler.add(seq)
        except ValueError as exc:
            rec.error = str(exc)
            return False
        return True

    def step(self, out: SchedulerOutput, next_arrival_s: float | None = None) -> list[Seq]:
        """Run one scheduled iteration on the simulated clock; returns the finished sequences.
        ``next_arrival_s``: the next request's arrival (after ``now``), which stops a multi-step
        decode; None: no request is left to arrive."""
        duration, decode_times, prefill_time, streams = self._timing(out, next_arrival_s)
        plan = out.plan
        if not plan.spatial and out.decodes and out.num_prefill_tokens:  # as the engine reports it
            self.scheduler.policy.observe_iteration(plan, duration)
        elif streams is not None and out.decodes:  # a split: its streams' times, as the engine's events
            t_d, t_p = streams
            tail = max(0.0, t_p - len(decode_times) * t_d) if out.prefills else None
            self.scheduler.policy.observe(plan, t_d, t_p if out.prefills else None, tail)
        self.iterations.append(IterationRecord(self.now, duration, plan.predicted_s, plan.spatial, plan.slo_risk,
                                               plan.s_decode, plan.k, len(out.decodes), out.num_prefill_tokens))
        before = {s.seq.seq_id: s.seq.num_output_tokens for s in out.scheduled}
        sampled = {s.seq.seq_id: [FAKE_TOKEN] * len(decode_times) for s in out.decodes}
        sampled.update({s.seq.seq_id: [FAKE_TOKEN] for s in out.prefills if s.samples})
        finished = self.scheduler.postprocess(out, sampled, prefill_done=prefill_time is not None)
        for s in out.decodes:
            self._record(s.seq, decode_times[:s.seq.num_output_tokens - before[s.seq.seq_id]])
        if prefill_time is not None:
            for s in out.prefills:
                self._record(s.seq, [prefill_time] * (s.seq.num_output_tokens - before[s.seq.seq_id]))
        self.now += duration
        if self.scheduler.has_unfinished():  # the engine's host time before the next iteration (gap_s)
            self.now += self.cm.profile.gap_s(len(out.scheduled))
        return finished

    def _record(self, seq: Seq, times: list[float]) -> None:
        rec = self.records[seq.seq_id]
        rec.chunk_times_s.extend(t - rec.start_s for t in times)
        rec.output_tokens = seq.num_output_tokens

    def _timing(self, out: SchedulerOutput, next_arrival_s: float | None
                ) -> tuple[float, list[float], float | None, tuple[float, float] | None]:
        """(iteration seconds, time of each decode step's tokens, time of the prefill's first
        tokens or None while a layer-split prefill is unfinished, a split's ``(t_d, t_p)`` or None)."""
        plan, decode, prefill = out.plan, _reqs(out.decodes), _reqs(out.prefills)
        if not plan.spatial and plan.k > 1:  # multi-step decode (the scheduler gives it no prefill)
            gpu = float(self.cm.predict_total(decode, self.total_sms, host=False))
            host = float(self.cm.predict_total(decode, self.total_sms)) - gpu
            gpu = self._actual(gpu)
            steps = 1 + sum(next_arrival_s is None or self.now + host + max(0, j - 1) * gpu < next_arrival_s
                            for j in range(1, self._room_steps(out)))
            end = self.now + host + steps * gpu
            return end - self.now, [self.now + host + i * gpu for i in range(1, steps + 1)], end, None
        if plan.prefill_layers is not None and prefill:
            return (*self._layer_round(out, decode, prefill), None)
        if plan.spatial:
            t_d, t_p = self._spatial(decode, prefill, plan.s_decode)
            # The executor starts no decode step near the prefill's end (ModelRunner._execute_spatial).
            steps = executed_steps(t_d, t_p, plan.k) if prefill else plan.k
            host = len(decode) * self.cm.profile.host_per_request_s  # before both streams (planner.optimizer)
            duration = host + max(steps * t_d, t_p)
            return (duration, [self.now + host + i * t_d for i in range(1, steps + 1)], self.now + duration,
                    (t_d, t_p))
        duration = self._actual(float(self.cm.predict_total(decode + prefill, self.total_sms)))
        return duration, [self.now + duration], self.now + duration, None

    def _room_steps(self, out: SchedulerOutput) -> int:
        """Steps of a multi-step decode the engine launches before a decode's end makes room for
        the first waiting request (``LLMEngine._interrupted``, ``Scheduler.can_admit``): step
        ``j >= 1`` is launched while the engine has applied the steps before ``j - 2``, so if
        room appears once ``r`` steps are applied, ``r + 2`` steps run (1 if there is room at the
        start); ``plan.k`` if no end makes room."""
        k = out.plan.k
        for r in sorted({0} | {d.max_steps for d in out.decodes if d.max_steps < k}):
            if self.scheduler.can_admit([d.seq for d in out.decodes if d.max_steps <= r]):
                return 1 if r == 0 else min(k, r + 2)
        return k

    def _layer_round(self, out: SchedulerOutput, decode: list[tuple[int, int]],
                     prefill: list[tuple[int, int]]) -> tuple[float, list[float], float | None]:
        """One pdmux round (see the module docstring)."""
        plan, layers = out.plan, self.config.planner.shape.layers
        t_d, t_p = 0.0, 0.0
        if plan.spatial:
            t_d, t_p = self._spatial(decode, prefill, plan.s_decode)
        if self.split is None or not self.split.holds(out.prefills):
            if not plan.spatial:
                t_p = self._actual(float(self.cm.predict_total(prefill, self.total_sms, graphs=False)))
            self.split = _LayerSplit(out.prefills, t_p / layers, layers, self.now)
        split = self.split
        submitted = min(plan.prefill_layers, split.layers_left)
        split.layers_left -= submitted
        split.busy_until_s = max(split.busy_until_s, self.now) + submitted * split.layer_s
        end = self.now + t_d if decode else split.busy_until_s
        # beside decodes the engine delivers in the first round after the one that queued the
        # last layer whose start finds them done; alone, a round waits for its layers
        done = not split.layers_left and (not decode or (not submitted and split.busy_until_s <= self.now))
        if not done:
            return end - self.now, [end], None
        self.split = None
        return end - self.now, [end], end


def simulate(trace: Sequence[TraceRequest], policy: Policy, config: SimConfig, progress: bool = False,
             label: str = "") -> SimResult:
    """Replay ``trace`` (arrivals in seconds from 0, sorted) through the engine's scheduler
    under ``policy``, on the cost model's clock.

    Args:
        progress: show a tqdm bar of finished requests (on a terminal).
        label: the bar's description.

    Raises:
        ValueError: bad memory settings (see ``kv_cache_tokens``).
        RuntimeError: the scheduler stops making progress with requests left (a bug).
    """
    start = time.perf_counter()
    run = _Run(trace, policy, config)
    sched, nxt = run.scheduler, 0
    with tqdm(total=len(trace), desc=label, unit="req", disable=None if progress else True) as bar:
        while nxt < len(trace) or sched.has_unfinished():
            while nxt < len(trace) and trace[nxt].arrival_s <= run.now:
                bar.update(0 if run.add(nxt) else 1)
                nxt += 1
            out = sched.schedule()
            if out.is_empty:
                if nxt == len(trace) and sched.has_unfinished():
                    raise RuntimeError(f"simulation stalled at {run.now:.3f} s with requests left")
                if nxt < len(trace):
                    run.now = max(run.now, trace[nxt].arrival_s)
                continue
            bar.update(len(run.step(out, trace[nxt].arrival_s if nxt < len(trace) else None)))
    ends = [r.arrival_s + r.chunk_times_s[-1] for r in run.records if r.chunk_times_s]
    return SimResult(policy.name, run.records, run.iterations, max(ends, default=0.0), sched.num_preemptions,
                     run.blocks.num_blocks * run.blocks.block_size, time.perf_counter() - start)
