"""Per-iteration partition optimizer: temporal or spatial (S_p, S_d, k) under a TBT SLO.

docs/design.md section 4 and the DuetServe paper's Algorithm 1:

1. If the mixed batch on all SMs meets the SLO, ``t_mixed(S) <= tau``, run it temporally.
2. Otherwise enumerate the decode partition ``S_d`` over the backend's granularity, skip
   those with ``t_d(S_d) > tau``, give prefill ``S_p = S - S_d``, try
   ``k in {floor(t_p / t_d), floor(t_p / t_d) + 1}`` (at least 1, at most ``max_k``) and keep
   the plan with the highest token rate ``(k T_decode + T_prefill) / max(k t_d, t_p)``.
3. If no ``S_d`` is feasible (or there is no partition backend), fall back to a temporal
   batch with the largest prefill token count whose prediction fits ``tau`` (``trim_prefill``
   gives the rule), flagged ``slo_risk``.

Beyond the paper:

* ``t_d`` and ``t_p`` include the interference of the other stream and the decode margin
  (``CostModel.predict_spatial``), measured on the H200 in docs/design.md section 5.
* ``k`` is capped by ``max_k``, the decode tokens still wanted: steps past it produce nothing.
* Tail gap: when decode finishes its k steps before prefill (``k t_d < t_p``), its next
  token waits for the prefill to end and for one more step, a gap of
  ``t_p - k t_d + t_d`` seconds. A ``k`` whose gap exceeds ``tau`` breaks the SLO for that
  token and is skipped, unless ``k == max_k`` (no decode token is left to wait).
  ``k = floor + 1`` never leaves a gap, so a feasible ``S_d`` always keeps a candidate.
* The engine runs ``executed_steps(t_d, t_p)`` decode steps beside the prefill, not ``k``
  (``k`` is the most it may run); ``trim_margin`` prices the split at those steps.
* The first decode step also waits for the iteration's host work (scheduling, the step's
  inputs), which later steps overlap with the step before: it must fit ``t_d + R h_r`` into
  the first-token budget, for ``R`` decodes and the profile's ``host_per_request_s`` ``h_r``,
  the host time a temporal iteration is priced with (``cost_model`` module docstring). On the
  H200 serving Mooncake, a split's iteration took 5 ms (median, about 30 decodes) beyond its
  two streams, and in one run 497 of 893 gaps over the SLO were a split's first decode tokens
  (docs/benchmarks.md, fifteenth session).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from duetserve.planner.cost_model import CostModel, Request

STEP_START_SHARE = 0.5  # executed_steps: least share of a decode step left of the prefill to start one


@dataclass(frozen=True)
class Plan:
    """One iteration's execution plan, shared by the optimizer, the policies, the engine's
    scheduler and the simulator. ``Plan()`` is a temporal plan with nothing predicted.

    Temporal plans (``spatial=False``) run the whole batch on all SMs once with ``k == 1``;
    the optimizer sets ``s_prefill == s_decode == total_sms`` and the three predicted times
    to the mixed batch's (``Plan()`` leaves the SM counts 0: not planned for a GPU).
    Spatial plans run ``k`` decode steps on ``s_decode`` SMs beside one prefill batch on
    ``s_prefill`` SMs; ``predicted_decode_s`` is one decode step, ``predicted_prefill_s``
    the prefill batch and ``predicted_s = max(k t_d, t_p)``. Times in seconds (None: not
    predicted), SMs as counts.

    ``prefill_token_limit`` is set only by the fallback: the caller must cut the
    iteration's prefill tokens to at most this many (``trim_prefill``); ``slo_risk``
    marks that fallback (and a decode-only batch that alone exceeds tau).

    ``prefill_layers`` (pdmux only): the prefill batch is cut by layers and each round
    submits this many of its layers beside one decode step, so the batch spans several
    iterations (``duetserve.planner.policies.PdmuxPolicy``); None runs every layer at once.

    ``trim_rates`` (tokens a second, for the iteration log): with a trim margin, the two rates
    ``plan_iteration`` weighed when it found a split, the trimmed temporal batch's (at its
    ``temporal_scale``) and the split's (at the steps the engine runs); the higher one's plan
    is this one. None when no such comparison ran.

    ``decode_margin`` (for the iteration log): the factor the decode side of a spatial plan was
    priced with beyond the interference (``CostModel.decode_margin`` times
    ``decode_level_scale[s_decode]``: duet's learned correction for that level times its
    spread); None where the policy sets none.
    """

    spatial: bool = False
    s_prefill: int = 0
    s_decode: int = 0
    k: int = 1
    predicted_s: float | None = None
    predicted_decode_s: float | None = None
    predicted_prefill_s: float | None = None
    prefill_token_limit: int | None = None
    slo_risk: bool = False
    prefill_layers: int | None = None
    trim_rates: tuple[float, float] | None = None
    decode_margin: float | None = None


def trim_prefill(prefill_reqs: Sequence[Request], token_limit: int) -> list[Request]:
    """The prefill chunks kept under ``token_limit`` tokens: requests keep their order,
    each keeps its first tokens (q shrinks, c is unchanged), and requests left with
    zero tokens are dropped. Raises ValueError for a negative limit."""
    if token_limit < 0:
        raise ValueError("token_limit must be >= 0")
    kept, left = [], token_limit
    for q, c in prefill_reqs:
        if left <= 0:
            break
        kept.append((min(q, left), c))
        left -= kept[-1][0]
    return kept


def plan_iteration(cost_model: CostModel, decode_reqs: Sequence[Request], prefill_reqs: Sequence[Request],
                   tau: float, total_sms: int, granularity: int | None, min_sms: int | None = None,
                   max_k: int | None = None, carry_s: float = 0.0, trim_margin: float | None = None,
                   temporal_scale: float = 1.0) -> Plan:
    """Choose this iteration's plan (docs/design.md section 4; see the module docstring).

    Args:
        cost_model: latency predictor.
        decode_reqs: (q, c) of the decode requests (q is 1 for plain decode).
        prefill_reqs: (q, c) of the prefill chunks scheduled this iteration.
        tau: TBT SLO in seconds.
        total_sms: SMs available to the iteration.
        granularity: SM step of partitions (8 for green contexts on Hopper, 2 for TPC masks);
            None when there is no partition backend: temporal plans only (step 3 replaces 2).
        min_sms: smallest partition for either side; defaults to ``granularity``.
        max_k: most decode steps worth running ahead (e.g. the longest remaining output
            among the decode requests); None for no cap.
        carry_s: seconds the decode requests have already waited for their next token when
            this iteration starts: the idle tail ``t_p - k t_d`` of a previous spatial plan
            whose prefill outlasted its decode steps. This iteration's first decode token
            must come within ``tau - carry_s`` (beyond the paper, which checks each plan alone).
        trim_margin: in (0, 1], or None (the paper's rule). When step 2 finds a split, also
            price a temporal batch with the prefill trimmed to fit ``trim_margin`` times the
            first-token budget (step 3's rule) and return it instead when its token rate
            ``(decodes + prefill kept) / t`` beats the split's, with the split run as the engine
            runs it (``executed_steps`` decode steps; beyond the paper: a smaller
            chunk on all SMs can beat splitting, as chunked prefill with a small budget did
            on the H200; the margin leaves room for prediction error). With decodes, step 1 also
            keeps a batch temporal only when it fits ``trim_margin`` times that budget: a batch
            predicted just under the SLO breaks it as often as a trimmed one would without the
            margin (beyond the paper; simulated with a 5% prediction error on Azure code at QPS
            16 and a 4096-token budget, p99 TBT fell from 104.5 to 98.9 ms; docs/benchmarks.md,
            thirtieth session).
        temporal_scale: measured / predicted time of temporal iterations (> 0); the trimmed
            batch's rate in that comparison is taken at ``predicted_s * temporal_scale``, as the
            split's prediction carries its own learned scales (``DuetPolicy.observe``).

    Raises:
        ValueError: for tau <= 0, granularity < 1, min_sms < 1, max_k < 1, trim_margin
            outside (0, 1], temporal_scale <= 0, or SM counts the cost model rejects.
    """
    if tau <= 0 or (granularity is not None and granularity < 1) or (min_sms is not None and min_sms < 1) \
            or (max_k is not None and max_k < 1) or (trim_margin is not None and not 0 < trim_margin <= 1) \
            or temporal_scale <= 0:
        raise ValueError("tau, granularity, min_sms, max_k and temporal_scale must be positive and trim_margin "
                         "in (0, 1]")
    decode, prefill = _as_array(decode_reqs), _as_array(prefill_reqs)
    t_mixed = float(cost_model.predict_total(np.concatenate([decode, prefill]), total_sms))
    first_tau = tau - max(carry_s, 0.0) if len(decode) else tau  # budget of the first decode token
    fits = first_tau if trim_margin is None or not len(decode) else trim_margin * first_tau
    if t_mixed <= fits or not len(prefill):
        return _temporal(t_mixed, total_sms, slo_risk=t_mixed > first_tau)
    if not len(decode):  # no token waits on this batch, so there is no TBT to protect
        return _temporal(t_mixed, total_sms, slo_risk=False)
    if granularity is None:
        return _fallback(cost_model, decode, prefill, first_tau, total_sms)
    min_sms = granularity if min_sms is None else min_sms
    first = -(-min_sms // granularity) * granularity
    s_d = np.arange(first, total_sms - min_sms + 1, granularity)
    first_host = len(decode) * cost_model.profile.host_per_request_s  # before the first step (module docstring)
    plan = _best_spatial(cost_model, decode, prefill, tau, first_tau - first_host, total_sms, s_d, max_k) \
        if s_d.size else None
    if plan is None:
        return _fallback(cost_model, decode, prefill, first_tau, total_sms)
    if trim_margin is not None:
        trimmed = _fallback(cost_model, decode, prefill, trim_margin * first_tau, total_sms)
        steps = executed_steps(plan.predicted_decode_s, plan.predicted_prefill_s, max_k)  # what would run
        span = first_host + max(steps * plan.predicted_decode_s, plan.predicted_prefill_s)  # host: as trimmed's
        rates = ((len(decode) + trimmed.prefill_token_limit) / (trimmed.predicted_s * temporal_scale),
                 float(steps * len(decode) + prefill[:, 0].sum()) / span)
        if rates[0] > rates[1]:
            return dataclasses.replace(trimmed, slo_risk=False, trim_rates=rates)
        return dataclasses.replace(plan, trim_rates=rates)
    return plan


def executed_steps(t_d: float, t_p: float, k: int | None = None) -> int:
    """Decode steps the engine's executor runs beside a prefill of ``t_p`` seconds, at ``t_d``
    seconds a step (``ModelRunner._execute_spatial``): step 1 always; each later step only while
    at least ``STEP_START_SHARE`` of a step is left of the prefill, so
    ``1 + floor(t_p / t_d - STEP_START_SHARE)`` steps (at least 1, at most ``k``). Beyond the
    paper, which runs its ``k``: a step started as the prefill ends holds the iteration, and the
    prefill's SMs, for most of a step; one not started holds the decodes for less than
    ``STEP_START_SHARE`` of a step (the next plan's ``carry_s``)."""
    steps = 1 + max(0, math.floor(t_p / t_d - STEP_START_SHARE))
    return steps if k is None else max(1, min(steps, k))


def _as_array(reqs: Sequence[Request] | np.ndarray) -> np.ndarray:
    return np.asarray(reqs, dtype=np.int64).reshape(-1, 2)


def _temporal(t: float, total_sms: int, slo_risk: bool, token_limit: int | None = None) -> Plan:
    return Plan(False, total_sms, total_sms, 1, t, t, t, token_limit, slo_risk)


def _best_spatial(cost_model: CostModel, decode: np.ndarray, prefill: np.ndarray, tau: float, first_tau: float,
                  total_sms: int, s_d: np.ndarray, max_k: int | None) -> Plan | None:
    """Enumerate S_d x {floor, floor+1} in one vectorised pass; None if nothing is feasible.
    The first decode step must fit ``first_tau`` (tau less the carried wait and the first
    step's host time), the others tau."""
    t_d, t_p = cost_model.predict_spatial(decode, prefill, s_d, total_sms)
    floor = np.floor(t_p / t_d)
    k = np.stack([np.maximum(floor, 1), floor + 1])  # shape (2, len(s_d))
    if max_k is not None:
        k = np.minimum(k, max_k)
    span = np.maximum(k * t_d, t_p)
    tail_ok = np.maximum(t_p - k * t_d, 0) + t_d <= tau
    if max_k is not None:
        tail_ok |= k == max_k
    ok = (t_d <= first_tau) & tail_ok
    if not ok.any():
        return None
    rate = np.where(ok, (k * decode[:, 0].sum() + prefill[:, 0].sum()) / span, -np.inf)
    row, col = np.unravel_index(np.argmax(rate), rate.shape)
    return Plan(True, int(total_sms - s_d[col]), int(s_d[col]), int(k[row, col]), float(span[row, col]),
                float(t_d[col]), float(t_p[col]))


def _fallback(cost_model: CostModel, decode: np.ndarray, prefill: np.ndarray, tau: float, total_sms: int) -> Plan:
    """Largest prefill token count whose temporal mixed batch fits tau (0 if even decode alone
    does not fit). The prediction grows with the token count, so each round evaluates a grid
    of counts at once (``CostModel.predict_variants``) and keeps the bracket where it crosses
    tau; a grid of sqrt(tokens) points finishes in two rounds."""
    q_pre = prefill[:, 0]
    before = np.cumsum(q_pre) - q_pre  # prefill tokens of the requests ahead of each one
    lo, hi = 0, int(q_pre.sum())  # hi is known not to fit
    grid = math.isqrt(hi) + 1
    while True:
        limits = np.unique(np.linspace(lo, hi, grid + 1).astype(np.int64))[:-1]
        q_trim = np.clip(limits[None, :] - before[:, None], 0, q_pre[:, None])  # trim_prefill per column
        t = cost_model.predict_variants(decode, q_trim, prefill[:, 1], total_sms)
        fits = np.flatnonzero(t <= tau)
        if not fits.size:  # only in the first round: every later round re-evaluates a lo that fits
            return _temporal(float(t[0]), total_sms, slo_risk=True, token_limit=0)
        i = fits[-1]
        lo, hi = int(limits[i]), int(limits[i + 1]) if i + 1 < limits.size else hi
        if hi - lo <= 1:
            return _temporal(float(t[i]), total_sms, slo_risk=True, token_limit=lo)
