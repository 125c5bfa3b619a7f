"""The planner-driven scheduling policies ``duet`` and ``pdmux`` (docs/design.md section 2, "Policies").

Both satisfy ``duetserve.engine.policy.Policy``: the shared scheduler forms the candidate
batch and asks ``plan(decode_reqs, prefill_reqs, max_k)`` how to run it.

* ``DuetPolicy`` (DuetServe, docs/design.md section 4): chunked prefill under the token budget; the
  mixed batch runs temporally when its predicted time fits the TBT SLO, otherwise
  ``plan_iteration`` splits the SMs into a decode and a prefill partition on the partition
  backend's granularity, and falls back to a trimmed temporal batch when no split fits.
  Without a partition backend only the temporal plan and its fallback remain.
* ``PdmuxPolicy`` (SGLang ``--enable-pdmux``; the "PD multiplexing" notebook, docs/design.md
  "Sources"): whole prompts, no chunking; the stream group (fixed SM split) is chosen from the
  decode batch size; the prefill batch is cut by layers, ``prefill_layers_per_round`` per round,
  each round running one decode step beside the next layers, so one prefill batch spans several
  iterations.

How a prefill that is only partly through its layers is represented: the scheduler pins the
batch (``Plan.prefill_layers`` set) and hands it out again every round without advancing its
tokens, reusing the first round's plan (SGLang keeps the level until the prefill ends); the
executor counts the layers submitted and tells ``Scheduler.advance`` when the last one has
completed (``prefill_done``); only then do its sequences sample their first token and join
the decode batch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from duetserve.partition.base import BACKENDS
from duetserve.planner.cost_model import CostModel, ModelShape, Request
from duetserve.planner.hardware import HardwareProfile
from duetserve.planner.optimizer import Plan, executed_steps, plan_iteration
from duetserve.planner.pdmux import (
    PdmuxConfig,
    choose_group,
    prefill_layers_per_round,
    stream_groups,
)

TRIM_AUTO = "auto"  # PlannerConfig.trim_margin: follow the measured error (DuetPolicy.trim_margin)
TRIM_WINDOW = 256  # DuetPolicy.observe_iteration: temporal iterations remembered
TRIM_MIN_SAMPLES = 32  # before this many, the automatic margin is TRIM_START and the scale 1
TRIM_START = 0.7
TRIM_QUANTILE = 0.99  # the automatic margin leaves room for this quantile of measured / predicted (p99 TBT)
TRIM_BOUNDS = (0.5, 1.0)


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner-driven policies need.

    Attributes:
        shape: model dimensions (``ModelShape.preset`` or ``ModelShape.from_hf_config``).
        profile: GPU profile (``load_profile``); its ``num_sms`` are the SMs to share.
        tau_s: TBT SLO, seconds.
        partition_backend: ``greenctx``, ``tpcmask`` or ``none`` (``partition.base.BACKENDS``;
            ``none``: temporal plans only); granularity and smallest partition (SMs) come from
            the profile.
        pdmux: SGLang's pdmux settings.
        tp: tensor-parallel degree for the cost model.
        cuda_graphs: whether the engine replays decode-only iterations from CUDA graphs (False
            under ``enforce_eager``); with a profile that has per-kernel overheads, graph-replayed
            and eager iterations are priced differently (``cost_model`` module docstring).
        trim_margin: duet only: ``plan_iteration``'s ``trim_margin`` (None: off), or ``TRIM_AUTO``
            to follow the measured error of temporal iterations (``DuetPolicy.trim_margin``) and
            of spatial plans' decode steps (``DuetPolicy.decode_spread``).
        piecewise_tokens: the engine replays temporal iterations with prefill tokens of up to this
            many tokens from piecewise CUDA graphs (``CostModel``'s ``piecewise_tokens``; 0: none).

    Raises:
        ValueError: ``tau_s <= 0``, ``trim_margin`` neither ``TRIM_AUTO`` nor in (0, 1], or a backend that is not in
            ``BACKENDS`` or not in the profile.
    """

    shape: ModelShape
    profile: HardwareProfile
    tau_s: float
    partition_backend: str = "greenctx"
    pdmux: PdmuxConfig = field(default_factory=PdmuxConfig)
    tp: int = 1
    cuda_graphs: bool = True
    trim_margin: float | str | None = None
    piecewise_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tau_s <= 0:
            raise ValueError("the TBT SLO must be positive")
        if self.trim_margin not in (None, TRIM_AUTO) and (isinstance(self.trim_margin, str)
                                                          or not 0 < self.trim_margin <= 1):
            raise ValueError(f"the trim margin must be in (0, 1] or {TRIM_AUTO!r}")
        if self.partition_backend not in BACKENDS:
            raise ValueError(f"unknown partition backend {self.partition_backend!r}; known {', '.join(BACKENDS)}")
        if self.partition_backend != "none":
            self.profile.granularity(self.partition_backend)  # raises for a backend the GPU lacks

    @property
    def granularity(self) -> int | None:
        """SM step of partitions, or None without a partition backend."""
        return None if self.partition_backend == "none" else self.profile.granularity(self.partition_backend)

    @property
    def min_sms(self) -> int | None:
        """Smallest partition in SMs, or None without a partition backend."""
        return None if self.partition_backend == "none" else self.profile.min_partition_sms(self.partition_backend)

    @cached_property
    def cost_model(self) -> CostModel:
        """The cost model of ``shape`` on ``profile`` (bf16, ``tp`` GPUs): the roofline plus the
        profile's per-kernel overheads, so TBT predictions include them."""
        return CostModel(self.shape, self.profile, tp=self.tp, cuda_graphs=self.cuda_graphs,
                         piecewise_tokens=self.piecewise_tokens)


LOOKAHEAD_SLACK = 2  # KV slots reserved for up to this many times the optimizer's k
DECODE_FEEDBACK_WEIGHT = 0.3  # DuetPolicy.observe: exponent of one observation's ratio
MAX_DECODE_CORRECTION = 2.0  # DuetPolicy.observe: most the decode side is scaled by feedback
DECODE_CORRECTION_DECAY = 0.99  # DuetPolicy.plan: share of the correction's excess over 1 kept per temporal plan
PREFILL_SCALE_BOUNDS = (0.8, 1.5)  # DuetPolicy.observe: range of the prefill side's measured scale


class DuetPolicy:
    """DuetServe: temporal by default, spatial ``(S_p, S_d, k)`` when the mixed batch would
    break ``tau`` (``plan_iteration``, docs/design.md section 4). Chunked prefill, decode and prefill
    together. With partition backend ``none`` it never splits: a batch predicted over ``tau``
    has its prefill trimmed until it fits (``Plan.prefill_token_limit``, ``slo_risk``)."""

    name = "duet"
    chunked_prefill = True
    prefill_excludes_decode = False

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self.carry_s = 0.0  # idle tail of the last plan's decode stream, seconds: predicted, then measured (observe)
        self._last_requests: int | None = None  # requests of the last plan: the host gap after it (plan)
        self.cost_model = copy.copy(config.cost_model)  # its decode margin and prefill scale follow the feedback
        self.decode_correction = 1.0  # measured / predicted decode step of spatial plans (observe)
        self.level_corrections: dict[int, float] = {}  # the same per decode SM count (observe)
        self._base_margin = self.cost_model.decode_margin
        self._temporal_ratios: deque[float] = deque(maxlen=TRIM_WINDOW)  # observe_iteration
        self._learned: tuple[float, float] | None = None  # (trim margin, temporal scale) from those ratios
        self._decode_ratios: deque[float] = deque(maxlen=TRIM_WINDOW)  # observe, with TRIM_AUTO
        self.decode_spread = 1.0  # TRIM_AUTO: extra decode margin for the spread of measured / predicted (observe)

    @property
    def trim_margin(self) -> float | None:
        """The margin temporal batches are trimmed to when a split is planned (``plan_iteration``):
        the configured one, or with ``TRIM_AUTO`` ``1 / q`` for ``q`` the ``TRIM_QUANTILE``
        of measured / predicted over the last ``TRIM_WINDOW`` temporal iterations with decodes
        and prefill (``observe_iteration``), within ``TRIM_BOUNDS``; ``TRIM_START`` until
        ``TRIM_MIN_SAMPLES`` were seen. Beyond the paper: a fixed 0.85 broke the SLO on an H200
        host where those iterations ran 1.03x their prediction at the median and 1.28x at p90
        (docs/benchmarks.md, eleventh session); the p95 of a first version left p99 TBT at 107 ms
        for a 100 ms SLO on Azure code at QPS 16 (thirteenth session)."""
        if self.config.trim_margin != TRIM_AUTO:
            return self.config.trim_margin
        return TRIM_START if self._learned is None else self._learned[0]

    @property
    def temporal_scale(self) -> float:
        """Median measured / predicted of the temporal iterations ``observe_iteration`` saw (with
        ``TRIM_AUTO``, once ``TRIM_MIN_SAMPLES`` were seen; else 1): ``plan_iteration``'s
        ``temporal_scale``."""
        return 1.0 if self._learned is None else self._learned[1]

    def observe_iteration(self, plan: Plan, measured_s: float) -> None:
        """Wall seconds ``measured_s`` of an iteration with decodes and prefill that ran
        ``plan``; with ``TRIM_AUTO``, trimmed batches (``plan.trim_rates`` set) and other
        temporal plans predicted at ``TRIM_BOUNDS[0]`` of the TBT SLO or more feed
        ``trim_margin`` and ``temporal_scale``; anything else is ignored. (A trimmed batch is
        predicted just under ``trim_margin`` times the first-token budget, so at the lowest margin,
        or with a carried wait, under that length: it counts whatever its length, or a margin at
        its floor could never rise.)

        Beyond the paper: the short untrimmed ones are host-bound eager passes, whose error is the
        served host's launch time against the profile's, not the trimmed batches' error. On the H200
        serving Azure code at QPS 12, iterations with under 1024 prefill tokens (predicted 28 ms)
        ran 1.14-1.38x their prediction at the median and 1.5-1.74x at p90, those with 1024-4096
        tokens 0.97-0.99x and 1.05-1.07x; counted in, they held the margin near 0.55 against
        0.90 without them, so trimmed batches were cut to half the SLO and lost to splits, which
        delayed queued prompts (docs/benchmarks.md, twenty-fourth session)."""
        if self.config.trim_margin != TRIM_AUTO or plan.spatial or not plan.predicted_s or measured_s <= 0 \
                or (plan.trim_rates is None and plan.predicted_s < TRIM_BOUNDS[0] * self.config.tau_s):
            return
        self._temporal_ratios.append(measured_s / plan.predicted_s)
        if len(self._temporal_ratios) >= TRIM_MIN_SAMPLES:
            low, high = TRIM_BOUNDS
            q, median = np.quantile(self._temporal_ratios, [TRIM_QUANTILE, 0.5])
            self._learned = (min(high, max(low, 1.0 / float(q))), float(median))

    def plan(self, decode_reqs: list[Request], prefill_reqs: list[Request], max_k: int) -> Plan:
        """The optimizer's plan for the batch: ``(q, c)`` per decode and prefill request, at most
        ``max_k`` look-ahead decode steps.

        A spatial plan's ``k`` is ``LOOKAHEAD_SLACK`` times the optimizer's (within ``max_k``):
        the executor starts no decode step after the prefill has finished, nor one with less than
        ``STEP_START_SHARE`` of a step of it left (``executed_steps``), so ``k`` is only the most
        steps reserved; the slack keeps decode busy when the prefill runs long. Its
        ``predicted_s`` is the decodes' host time before both streams plus the longer stream,
        at those steps. The decodes then
        wait ``t_p - steps t_d`` for the prefill; that wait is carried into the next plan's
        first-token budget (``plan_iteration``'s ``carry_s``), or the measured one once ``observe``
        has it. So is the host time between the last plan's iteration and this one, which its
        decodes waited too: the profile's ``gap_s`` for the last plan's requests (beyond the paper;
        0 with a profile without gap terms; docs/benchmarks.md, twenty-ninth session: simulated
        unbudgeted, a 1-3 ms gap after temporal batches planned to the SLO broke it)."""
        c = self.config
        gap = 0.0 if self._last_requests is None else c.profile.gap_s(self._last_requests)
        plan = plan_iteration(self.cost_model, decode_reqs, prefill_reqs, c.tau_s, c.profile.num_sms,
                              c.granularity, c.min_sms, max_k, self.carry_s + gap, self.trim_margin,
                              self.temporal_scale)
        self._last_requests = len(decode_reqs) + len(prefill_reqs)
        self.carry_s = 0.0
        if plan.spatial and prefill_reqs:  # room for a prefill slower than predicted (executor stops at its end)
            k = min(max_k, LOOKAHEAD_SLACK * plan.k)
            t_d, t_p = plan.predicted_decode_s, plan.predicted_prefill_s
            steps = executed_steps(t_d, t_p, k)  # what the executor runs if the prediction holds
            margin = self.cost_model.decode_margin * float(self.cost_model.decode_level_scale[plan.s_decode])
            host = len(decode_reqs) * c.profile.host_per_request_s  # before both streams (plan_iteration)
            plan = dataclasses.replace(plan, k=k, predicted_s=host + max(steps * t_d, t_p), decode_margin=margin)
            self.carry_s = max(0.0, t_p - steps * t_d)
        if decode_reqs and prefill_reqs and not plan.spatial and \
                max(self.decode_correction, *self.level_corrections.values(), 1.0) > 1.0:
            # no spatial plan, so no new measurement: let the corrections relax toward 1, so one
            # that priced every split out does not keep them out for good
            def relax(c: float) -> float:
                return 1.0 + (c - 1.0) * DECODE_CORRECTION_DECAY
            self.level_corrections = {s: relax(c) for s, c in self.level_corrections.items()}
            self._set_correction(relax(self.decode_correction))
        return plan

    def observe(self, plan: Plan, decode_step_s: float, prefill_s: float | None,
                idle_tail_s: float | None = None) -> None:
        """Feedback from a spatial ``plan`` that ran: ``decode_step_s`` measured seconds per
        decode step (the decode stream's busy time over the steps run), ``prefill_s`` of its
        prefill stream (None: no prefill), ``idle_tail_s`` the decodes' wait for the prefill's
        end after their last step (None: not measured).

        The measured wait replaces the predicted one that ``plan`` carried into the next plan's
        first-token budget (``carry_s``). Beyond the paper: on the H200 serving Mooncake the
        measured wait exceeded the predicted one by up to 35 ms (p99; the executor runs the
        steps that fit, not the predicted count); with it and the first step's host time
        (``plan_iteration``) late gaps on first steps and in temporal iterations fell from 751 to
        135 of 64k (two runs minutes apart, not side by side; docs/benchmarks.md, fifteenth session).

        The decode side of later spatial predictions is scaled by ``decode_correction``, which
        moves geometrically toward measured / predicted (weight ``DECODE_FEEDBACK_WEIGHT`` per
        observation) and stays within [1, ``MAX_DECODE_CORRECTION``]: it only ever adds margin.
        Beyond the paper: on the H200 serving Mooncake, decode steps beside a prefill ran
        0.97x their prediction on 8 SMs but 1.2-1.6x on 16-32 SMs with 14-37 long-context
        decodes (docs/benchmarks.md, fourth H200 session), and each such step broke the SLO.
        Plans without a decode prediction or a step are ignored. Each iteration with decodes and
        prefill that ``plan`` keeps temporal moves the correction back toward 1 by the factor
        ``DECODE_CORRECTION_DECAY`` (no split, no new measurement).

        The same correction is also kept per decode SM count (``level_corrections``, starting
        from the global one at a level's first measurement, updated and relaxed alike); a plan
        on a measured level is priced with that level's, any other with the global one
        (``CostModel.decode_level_scale``). Beyond the paper: on the H200 the bias of the
        profile's prediction grew with the decode partition, measured / predicted 1.02 on 8
        SMs, 1.08-1.19 on 16, 1.26 on 32 and 1.46 on 48 (docs/benchmarks.md, fifteenth session),
        so one correction overpriced the small levels and underpriced the large ones.

        With ``TRIM_AUTO``, the decode side is also scaled by ``decode_spread``: the
        ``TRIM_QUANTILE`` over the median of measured / predicted over the last ``TRIM_WINDOW``
        spatial plans (1 until ``TRIM_MIN_SAMPLES`` were seen; never below 1), each ratio taken
        against the prediction with the level's correction but without the spread
        (``Plan.decode_margin`` divided out, the correction applied): the error the corrections
        leave, so the differences between levels, which they price, do not count as spread. The correction follows
        the middle of that ratio, so without the spread about half the steps planned right at
        ``tau`` run over; it is updated against the prediction without the spread, so the
        spread adds to it rather than replacing it. Beyond the paper: on the H200 serving Mooncake at QPS 1.5 that ratio was 0.94 /
        1.00 / 1.08 / 1.18 at p10 / p50 / p90 / p99, and p99 TBT reached 109 ms for a 100 ms
        SLO (docs/benchmarks.md, fourteenth session).

        The prefill side of spatial predictions is scaled by ``cost_model.prefill_scale``, which moves the same way toward measured / predicted, within
        ``PREFILL_SCALE_BOUNDS``, both ways: the executor holds decodes for the prefill's
        predicted end (``executed_steps``), so a bias either way costs. Beyond the paper: on
        the H200 the prefill stream of Azure code's spatial iterations ran 1.04x its
        prediction on one host and 1.07x on another (docs/benchmarks.md, eleventh session)."""
        if not plan.spatial:
            return
        if idle_tail_s is not None:
            self.carry_s = max(0.0, idle_tail_s)
        if prefill_s is not None and prefill_s > 0 and plan.predicted_prefill_s:
            ratio = prefill_s / plan.predicted_prefill_s
            low, high = PREFILL_SCALE_BOUNDS
            cm = self.cost_model
            cm.prefill_scale = min(high, max(low, cm.prefill_scale * ratio ** DECODE_FEEDBACK_WEIGHT))
        if not plan.predicted_decode_s or decode_step_s <= 0:
            return
        # measured / predicted without this policy's feedback (the factor the plan was priced
        # with is divided out), so a changed margin does not read as spread or as bias
        priced = plan.decode_margin if plan.decode_margin is not None else self._base_margin
        bias = decode_step_s / plan.predicted_decode_s * priced / self._base_margin
        level = self.level_corrections.get(plan.s_decode, self.decode_correction)  # the one this plan used
        if self.config.trim_margin == TRIM_AUTO:
            self._decode_ratios.append(bias / level)  # what the correction left: the levels' differences are priced
            if len(self._decode_ratios) >= TRIM_MIN_SAMPLES:
                q, median = np.quantile(self._decode_ratios, [TRIM_QUANTILE, 0.5])
                self.decode_spread = max(1.0, float(q / median))

        def toward_bias(c: float) -> float:
            return min(MAX_DECODE_CORRECTION, max(1.0, c * (bias / c) ** DECODE_FEEDBACK_WEIGHT))
        self.level_corrections[plan.s_decode] = toward_bias(level)
        self._set_correction(toward_bias(self.decode_correction))

    def _set_correction(self, value: float) -> None:
        """The global correction becomes ``value``; the cost model's decode margin and per-level
        scale follow it, the spread and the level corrections."""
        self.decode_correction = value
        self.cost_model.decode_margin = self._base_margin * value * self.decode_spread
        scale = np.ones(self.config.profile.num_sms + 1)  # a new array: the config's model shares the old
        for sms, level in self.level_corrections.items():
            scale[sms] = level / value
        self.cost_model.decode_level_scale = scale


class PdmuxPolicy:
    """SGLang's PD multiplexing: fixed stream groups, whole prompts cut by layers.

    Each round: with decode and prefill, the group ``choose_group`` picks from the decode
    batch size, one decode step on its decode SMs beside ``prefill_layers_per_round`` layers
    of the prefill batch on its prefill SMs (``Plan(spatial=True, k=1, prefill_layers=n)``);
    prefill alone: every SM to prefill, still cut by layers; decode alone: a temporal plan on
    every SM. Predicted times: ``predicted_decode_s`` one decode step, ``predicted_prefill_s``
    the whole prefill batch on its SMs, ``predicted_s`` the round, which waits only for the
    decode step when there is one (SGLang syncs the decode stream each round; the prefill
    layers queue on their own stream), else for the round's share of the prefill layers.

    Raises:
        ValueError: the config has no partition backend (pdmux needs green contexts or TPC
            masks), or SGLang's split rule has no level for the GPU.
    """

    name = "pdmux"
    chunked_prefill = False
    prefill_excludes_decode = False

    def __init__(self, config: PlannerConfig) -> None:
        if config.granularity is None:
            raise ValueError("--policy pdmux needs an SM partition backend (greenctx or tpcmask); "
                             "the partition backend is 'none'")
        self.config = config
        self.groups = stream_groups(config.profile.num_sms, config.profile.compute_capability_major, config.pdmux)

    def observe(self, plan: Plan, decode_step_s: float, prefill_s: float | None,
                idle_tail_s: float | None = None) -> None:
        """No feedback: SGLang's levels are fixed."""

    def observe_iteration(self, plan: Plan, measured_s: float) -> None:
        """No feedback (see ``observe``)."""

    def decode_levels(self) -> list[int]:
        """Decode SM counts of the split groups (the engine records decode graphs for these)."""
        return [d for _, d in self.groups if 0 < d < self.config.profile.num_sms]

    def plan(self, decode_reqs: list[Request], prefill_reqs: list[Request], max_k: int) -> Plan:
        """The round's plan for ``(q, c)`` decode and prefill requests (``max_k`` is unused:
        pdmux runs one decode step per round)."""
        cm, total, layers = self.config.cost_model, self.config.profile.num_sms, self.config.shape.layers
        if not prefill_reqs:
            t = float(cm.predict_total(decode_reqs, total))
            return Plan(False, total, total, 1, t, t, t)
        n = prefill_layers_per_round(sum(q for q, _ in prefill_reqs), layers, self.config.pdmux)
        if not decode_reqs:
            t_p = float(cm.predict_total(prefill_reqs, total, graphs=False))  # layer rounds run eagerly
            return Plan(False, total, 0, 1, t_p * n / layers, None, t_p, prefill_layers=n)
        s_p, s_d = self.groups[choose_group(len(self.groups), len(decode_reqs), True, self.config.pdmux)]
        t_d, t_p = (float(x) for x in cm.predict_spatial(decode_reqs, prefill_reqs, s_d, total))
        return Plan(True, s_p, s_d, 1, t_d, t_d, t_p, prefill_layers=n)
