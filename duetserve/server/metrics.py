"""Prometheus metrics: vLLM's names where the meaning is the same, plus duetserve's own."""
from __future__ import annotations

import json
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from duetserve.engine.engine import LLMEngine, RequestOutput, StepStats
from duetserve.planner.cost_model import CostModel

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


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
        # same events), "handout_s" (wall seconds from the iteration's start at which each decode
        # step's tokens were handed out) and "launch_s" (those at which the prefill had been
        # launched; null without a prefill beside decode steps), "num_decodes", "num_prefills"
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
        self._label = label
        names = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", names, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", names, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.", names, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests that got a first token.",
                                     names, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", names, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (recompute).", names, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests.", names + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", names,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output chunks of a request.",
                             names, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", names,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.iterations = Counter("duetserve:iterations", "Engine iterations by plan.", names + ["plan"], registry=r)
        self.spatial = Counter("duetserve:spatial_iterations", "Iterations run with a spatial plan.", names,
                               registry=r)
        self.slo_risk = Counter("duetserve:slo_risk_iterations", "Iterations no plan was predicted to keep "
                                "within the TBT SLO.", names, registry=r)
        self.partition_sms = Gauge("duetserve:partition_sms", "SMs given to each stream in the last iteration.",
                                   names + ["stream"], registry=r)
        self.lookahead = Gauge("duetserve:lookahead_steps",
                               "Decode steps the last iteration ran (at most its plan's k).",
                               names, registry=r)
        self.predicted_vs_measured = Gauge("duetserve:predicted_vs_measured_seconds",
                                           "Last iteration's predicted and measured time.", names + ["kind"],
                                           registry=r)
        self.iteration_time = Histogram("duetserve:iteration_duration_seconds", "Wall time of an iteration.",
                                        names, buckets=_LATENCY_BUCKETS, registry=r)
        self._arrival: dict[str, float] = {}
        self._last: dict[str, float] = {}

    def watch_engine(self, engine: LLMEngine) -> None:
        """Read running/waiting counts and KV usage from ``engine`` at every scrape; take its cost
        model (``LLMEngine.cost_model``) and the host terms it predicts with for the iteration log."""
        self._cost_model = engine.cost_model
        profile = self._cost_model.profile
        self._planning = {"host_per_request_s": profile.host_per_request_s, "host_eager_s": profile.host_eager_s,
                          "host_piecewise_s": profile.piecewise_host_s, "cuda_graphs": self._cost_model.cuda_graphs,
                          "piecewise_tokens": self._cost_model.piecewise_tokens}
        lab = self._label
        self.running.labels(**lab).set_function(lambda: len(engine.scheduler.running))
        self.waiting.labels(**lab).set_function(lambda: len(engine.scheduler.waiting))
        self.kv_usage.labels(**lab).set_function(lambda: engine.block_manager.usage)

    def on_arrival(self, request_id: str, now: float) -> None:
        self._arrival[request_id] = now

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput], now: float) -> None:
        lab = self._label
        if stats is not None:
            plan = stats.plan
            self.preemptions.labels(**lab).inc(stats.num_preempted)
            self.iterations.labels(plan="spatial" if plan.spatial else "temporal", **lab).inc()
            self.iteration_time.labels(**lab).observe(stats.duration_s)
            if plan.spatial:
                self.spatial.labels(**lab).inc()
            if plan.slo_risk:
                self.slo_risk.labels(**lab).inc()
            self.partition_sms.labels(stream="prefill", **lab).set(plan.s_prefill)
            self.partition_sms.labels(stream="decode", **lab).set(plan.s_decode)
            self.lookahead.labels(**lab).set(stats.decode_steps)
            self.predicted_vs_measured.labels(kind="measured", **lab).set(stats.duration_s)
            # the cost model's prediction costs ~0.1 ms of host time: only for the log, and for a
            # multi-step decode (several steps a call), whose plan carries none
            predicted = (self._predicted(stats) if self._iteration_log is not None or _multi_step(stats)
                         else plan.predicted_s)
            if predicted is not None:
                self.predicted_vs_measured.labels(kind="predicted", **lab).set(predicted)
            if self._iteration_log is not None:
                self._iteration_log.write(json.dumps({
                    "t": time.time(), "spatial": plan.spatial, "s_decode": plan.s_decode, "s_prefill": plan.s_prefill,
                    "k": plan.k, "steps": stats.decode_steps, "predicted_s": predicted,
                    "measured_s": stats.duration_s, "predicted_decode_s": plan.predicted_decode_s,
                    "predicted_prefill_s": plan.predicted_prefill_s,
                    "decode_stream_s": stats.stream_s.get("decode"), "prefill_stream_s": stats.stream_s.get("prefill"),
                    "decode_tail_s": stats.stream_s.get("tail"), "handout_s": stats.handout_s,
                    "launch_s": stats.launch_s,
                    "num_decodes": stats.num_decodes, "num_prefills": stats.num_prefills,
                    "num_prefill_tokens": stats.num_prefill_tokens, "prefill_layers": plan.prefill_layers,
                    "schedule_s": stats.schedule_s, "gap_s": stats.gap_s, "trim_rates": plan.trim_rates,
                    "decode_margin": plan.decode_margin,
                    "requests": [[s.num_new_tokens, s.num_cached_tokens] for s in stats.scheduled],
                    **self._planning}) + "\n")
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                self.generation_tokens.labels(**lab).inc(len(out.new_token_ids))
                if rid in self._last:
                    self.itl.labels(**lab).observe(now - self._last[rid])
                else:  # its first token: the prompt is prefilled (vLLM counts it then, aborted or not)
                    self.prompt_tokens.labels(**lab).inc(out.num_prompt_tokens)
                    if rid in self._arrival:
                        self.ttft.labels(**lab).observe(now - self._arrival[rid])
                self._last[rid] = now
            if out.finished:
                self.success.labels(finished_reason=out.finish_reason or "abort", **lab).inc()
                if rid in self._arrival:
                    self.e2e.labels(**lab).observe(now - self._arrival[rid])
                self._drop(rid)

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
            self.success.labels(finished_reason="abort", **self._label).inc()
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self._arrival.pop(request_id, None)
        self._last.pop(request_id, None)
