"""Prometheus metrics: vLLM's names where the meaning is the same, plus duetserve's own."""
from __future__ import annotations

import json
import logging
import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from duetserve.engine.async_engine import EngineFront
from duetserve.engine.engine import RequestOutput, StepStats
from duetserve.planner.cost_model import CostModel

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


log = logging.getLogger(__name__)

_UNSET = object()  # an iteration's prediction not made yet (ServerMetrics._last)


def _multi_step(stats: StepStats) -> bool:
    """Whether the iteration was a multi-step decode (temporal, no prefill, more than one step)."""
    return stats.decode_steps > 1 and not stats.num_prefill_tokens and not stats.plan.spatial


class ServerMetrics:
    """Holds the metrics of one server in its own registry and updates them from the engine loop.

    Times are seconds on the monotonic clock; TTFT counts from the request's arrival at the
    engine front to its first token, ITL between consecutive outputs of one request.
    """

    def __init__(self, model_name: str, iteration_log: str | None = None):
        # Optional JSONL, one line per iteration: {"t": unix seconds, "spatial", "s_decode",
        # "s_prefill", "k", "steps", "predicted_s", "measured_s", "predicted_decode_s" (one step),
        # "predicted_prefill_s", "decode_stream_s" / "prefill_stream_s" (each stream's busy time
        # between CUDA events, spatial plans on the GPU; else null), "decode_tail_s" (from the decode
        # stream's end to the prefill stream's: the decodes' wait, 0 when decode ended last; the
        # same events), "gpu_s" (a temporal plan's GPU span, first kernel to last, the same way;
        # "measured_s" less it is host time with the GPU idle), "handout_s" (wall seconds from the
        # iteration's start at which each decode step's tokens were handed out) and "launch_s"
        # (those at which the prefill had been launched; null without a prefill beside decode
        # steps), "num_decodes", "num_prefills"
        # (prefill chunks), "num_prefill_tokens", "prefill_layers" (pdmux rounds), "schedule_s"
        # (the scheduler's wall seconds, planning included, within "measured_s"), "trim_rates"
        # (Plan.trim_rates: trimmed temporal and split tokens/s that duet weighed), "decode_margin"
        # (Plan.decode_margin: duet's learned factor on the split's decode prediction), "requests"
        # ([new tokens, cached tokens] of each scheduled sequence, decodes first: the cost
        # model's (q, c), to refit it from a served run), the profile's
        # "host_per_request_s" / "host_eager_s" / "host_piecewise_s" the predictions include, whether
        # decode-only batches replay CUDA graphs, "cuda_graphs", and the most tokens an iteration
        # with prefill replays from piecewise graphs, "piecewise_tokens" (calibrate --iteration-log)}
        # (`duetserve bench --iteration-log` marks spatial iterations with it). Policies that
        # plan without a prediction (chunked, prefill-first) get the engine's cost model's.
        self._iteration_log = open(iteration_log, "a", buffering=1) if iteration_log else None  # noqa: SIM115
        self._planning: dict[str, float | bool] = {}  # host terms and graphs the predictions assume
        self._cost_model: CostModel | None = None  # predicts iterations whose plan has no prediction
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}
        names = ["model_name"]
        # Children bound to this server's label once: ``labels()`` costs ~2 us a call, which at 64
        # outputs a decode step was most of the engine thread's metrics time.
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", names,
                             registry=r).labels(**label)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", names,
                             registry=r).labels(**label)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.", names, registry=r).labels(**label)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests that got a first token.",
                                     names, registry=r).labels(**label)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", names,
                                         registry=r).labels(**label)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute).", names,
                                   registry=r).labels(**label)
        self._label = label
        self._success_metric = Counter("vllm:request_success", "Finished requests.", names + ["finished_reason"],
                                       registry=r)
        self.success = {reason: self._success_metric.labels(finished_reason=reason, **label)
                        for reason in ("stop", "length", "abort")}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", names,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output chunks of a request.",
                             names, buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", names,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        iterations = Counter("duetserve:iterations", "Engine iterations by plan.", names + ["plan"], registry=r)
        self.iterations = {spatial: iterations.labels(plan="spatial" if spatial else "temporal", **label)
                           for spatial in (False, True)}
        self.spatial = Counter("duetserve:spatial_iterations", "Iterations run with a spatial plan.", names,
                               registry=r).labels(**label)
        self.slo_risk = Counter("duetserve:slo_risk_iterations", "Iterations no plan was predicted to keep "
                                "within the TBT SLO.", names, registry=r).labels(**label)
        partition_sms = Gauge("duetserve:partition_sms", "SMs given to each stream in the last iteration.",
                              names + ["stream"], registry=r)
        self.prefill_sms = partition_sms.labels(stream="prefill", **label)
        self.decode_sms = partition_sms.labels(stream="decode", **label)
        self.lookahead = Gauge("duetserve:lookahead_steps",
                               "Decode steps the last iteration ran (at most its plan's k).",
                               names, registry=r).labels(**label)
        predicted_vs_measured = Gauge("duetserve:predicted_vs_measured_seconds",
                                      "Last iteration's predicted and measured time.", names + ["kind"], registry=r)
        self.measured = predicted_vs_measured.labels(kind="measured", **label)
        # read at scrape time: predicting an iteration the plan did not (a multi-step decode,
        # chunked's batches) costs the engine thread ~0.1-0.7 ms, paid per scrape unless logged
        predicted_vs_measured.labels(kind="predicted", **label).set_function(self._last_predicted)
        self._last: tuple[StepStats, float | None] | None = None  # last iteration, its prediction or _UNSET
        self._scraped: tuple[StepStats | None, float | None] = (None, None)  # _last_predicted's, made at a scrape
        self.iteration_time = Histogram("duetserve:iteration_duration_seconds", "Wall time of an iteration.",
                                        names, buckets=_LATENCY_BUCKETS, registry=r).labels(**label)
        self._arrival: dict[str, float] = {}
        self._last_token: dict[str, float] = {}

    def watch_engine(self, engine: EngineFront) -> None:
        """Read running/waiting counts and KV usage from ``engine`` (``EngineFront.num_running``,
        ``num_waiting``, ``kv_usage``) at every scrape; take its cost model (``EngineFront.cost_model``)
        and the host terms it predicts with for the iteration log."""
        self._cost_model = engine.cost_model
        profile = self._cost_model.profile
        self._planning = {"host_per_request_s": profile.host_per_request_s, "host_eager_s": profile.host_eager_s,
                          "host_piecewise_s": profile.piecewise_host_s, "cuda_graphs": self._cost_model.cuda_graphs,
                          "piecewise_tokens": self._cost_model.piecewise_tokens}
        self.running.set_function(engine.num_running)
        self.waiting.set_function(engine.num_waiting)
        self.kv_usage.set_function(engine.kv_usage)

    def on_arrival(self, request_id: str, now: float) -> None:
        self._arrival[request_id] = now

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput], now: float) -> None:
        if stats is not None:
            self._on_iteration(stats)
        generated = 0
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                generated += len(out.new_token_ids)
                last = self._last_token.get(rid)
                if last is not None:
                    self.itl.observe(now - last)
                else:  # its first token: the prompt is prefilled (vLLM counts it then, aborted or not)
                    self.prompt_tokens.inc(out.num_prompt_tokens)
                    if rid in self._arrival:
                        self.ttft.observe(now - self._arrival[rid])
                self._last_token[rid] = now
            if out.finished:
                self._finished(out.finish_reason or "abort")
                if rid in self._arrival:
                    self.e2e.observe(now - self._arrival[rid])
                self._drop(rid)
        if generated:
            self.generation_tokens.inc(generated)

    def _on_iteration(self, stats: StepStats) -> None:
        """The per-iteration metrics, and the iteration log's record."""
        plan = stats.plan
        self.preemptions.inc(stats.num_preempted)
        self.iterations[plan.spatial].inc()
        self.iteration_time.observe(stats.duration_s)
        if plan.spatial:
            self.spatial.inc()
        if plan.slo_risk:
            self.slo_risk.inc()
        self.prefill_sms.set(plan.s_prefill)
        self.decode_sms.set(plan.s_decode)
        self.lookahead.set(stats.decode_steps)
        self.measured.set(stats.duration_s)
        if self._iteration_log is None:
            self._last = (stats, _UNSET)
            return
        predicted = self._predicted(stats)
        self._last = (stats, predicted)
        self._iteration_log.write(json.dumps({
            "t": time.time(), "spatial": plan.spatial, "s_decode": plan.s_decode, "s_prefill": plan.s_prefill,
            "k": plan.k, "steps": stats.decode_steps, "predicted_s": predicted,
            "measured_s": stats.duration_s, "predicted_decode_s": plan.predicted_decode_s,
            "predicted_prefill_s": plan.predicted_prefill_s,
            "decode_stream_s": stats.stream_s.get("decode"), "prefill_stream_s": stats.stream_s.get("prefill"),
            "decode_tail_s": stats.stream_s.get("tail"), "gpu_s": stats.stream_s.get("gpu"),
            "handout_s": stats.handout_s,
            "launch_s": stats.launch_s,
            "num_decodes": stats.num_decodes, "num_prefills": stats.num_prefills,
            "num_prefill_tokens": stats.num_prefill_tokens, "prefill_layers": plan.prefill_layers,
            "schedule_s": stats.schedule_s, "gap_s": stats.gap_s, "trim_rates": plan.trim_rates,
            "decode_margin": plan.decode_margin,
            "requests": [[s.num_new_tokens, s.num_cached_tokens] for s in stats.scheduled],
            **self._planning}) + "\n")

    def _last_predicted(self) -> float:
        """The gauge ``duetserve:predicted_vs_measured_seconds{kind="predicted"}`` at a scrape: the
        last iteration's predicted seconds (``_predicted``, made here once when the iteration log
        did not); 0 before any iteration, as the measured time reads; NaN for an iteration without
        a prediction."""
        last = self._last
        if last is None:
            return 0.0
        stats, predicted = last
        if predicted is _UNSET:  # made on the scraping thread; kept beside, not in, the engine thread's _last
            if self._scraped[0] is not stats:
                try:
                    self._scraped = (stats, self._predicted(stats))
                except Exception:  # a scrape must not fail: the gauge reads NaN
                    log.exception("predicting the last iteration for /metrics failed")
                    self._scraped = (stats, None)
            predicted = self._scraped[1]
        return math.nan if predicted is None else predicted

    def _predicted(self, stats: StepStats) -> float | None:
        """The iteration's predicted seconds: for a multi-step decode, the engine cost model's for
        the steps that ran, which ``measured_s`` covers (``CostModel.predict_steps``: host time
        once); else the plan's, or for a plan without one the cost model's for the batch on all
        SMs; None without a model."""
        plan, model = stats.plan, self._cost_model
        if model is None or not stats.scheduled or (plan.predicted_s is not None and not _multi_step(stats)):
            return plan.predicted_s
        reqs = [(s.num_new_tokens, s.num_cached_tokens) for s in stats.scheduled]
        if _multi_step(stats):
            return model.predict_steps(reqs, model.profile.num_sms, stats.decode_steps)
        return float(model.predict_total(reqs, model.profile.num_sms))

    def forget(self, request_id: str) -> None:
        """A request was aborted (e.g. its client went away): counted as finished with reason
        ``abort`` (vLLM's label) if it was still running; its timing state is dropped."""
        if request_id in self._arrival:
            self._finished("abort")
        self._drop(request_id)

    def _finished(self, reason: str) -> None:
        child = self.success.get(reason)
        if child is None:  # a reason not bound in advance
            child = self.success[reason] = self._success_metric.labels(finished_reason=reason, **self._label)
        child.inc()

    def _drop(self, request_id: str) -> None:
        self._arrival.pop(request_id, None)
        self._last_token.pop(request_id, None)
