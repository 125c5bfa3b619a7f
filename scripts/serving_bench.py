"""Serving benchmark through the HTTP server: every configuration x trace x QPS in one process budget.

A configuration is a policy of ``--policies`` or a ``--variant LABEL=SERVE_ARGS`` (serve flags
with their own ``--policy``), named by its label in every output. For each it starts ``python3
-m duetserve.cli serve`` once (dummy weights, iteration log on; the same start/stop code as
``duetserve bench --launch``), sends a short warm-up (so Triton compiles before anything is
timed), then runs ``python3 -m duetserve.bench`` once per (trace, QPS) against it: Poisson
arrivals re-drawn at the QPS over the trace's first ``ceil(QPS x seconds)`` requests (the
simulator's setting in docs/benchmarks.md), input lengths capped where asked. One server per
configuration instead of one per bench call halves the start-up cost, which a 10-minute device
call cannot spare.

``--gpus N`` splits the configurations round-robin into N lanes that run in parallel threads:
lane i runs its configurations one after another on port ``--port + i``, its servers seeing
``CUDA_VISIBLE_DEVICES=i`` when N > 1. Each configuration gets an equal share of the time its
lane has left, and every lane has the whole ``--deadline-s``; what no longer fits is skipped.

Everything lands in ``--out`` as at most six files, rewritten after every run so a kill
leaves what was done: ``serving.json`` (settings, environment, per-run metrics with spatial
share and predicted-vs-measured iteration error, and each run's full bench result),
``serving_table.md``, ``serving_<trace>.png`` (one per trace, the highest QPS, all
configurations) and ``iterations.jsonl.gz`` (the servers' iteration logs, with ``policy``: the
label). The caller's log is the sixth.

Used by scripts/device_serving.sh (GPU, and its CPU smoke mode).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRACE_FILES = {
    "azure_code": ("AzureLLMInferenceTrace_code.csv", "azure"),
    "azure_conv": ("AzureLLMInferenceTrace_conv.csv", "azure"),
    "mooncake": ("mooncake_conversation_trace.jsonl", "mooncake"),
}

TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32768, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "eos_token_id": 2}
"""A tiny Qwen3 for the CPU smoke run (vocabulary above bench's default token-id range 1000:32000)."""


def served_cost_model(model: Path, serve_args: Sequence[str] = ()) -> Any:
    """The cost model the server builds for ``model`` (a ``write_model`` folder) on the hardware
    profile its ``serve_args`` name (``--profile NAME|PATH``, the last one as serve reads them;
    serve's default without one), without piecewise graphs (``iteration_summary`` prices eager
    iterations).

    Raises ValueError (a malformed profile) or OSError (an unreadable one), as ``load_profile``."""
    from duetserve.config import EngineConfig
    from duetserve.planner.cost_model import CostModel, ModelShape
    from duetserve.planner.hardware import load_profile

    flags = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    flags.add_argument("--profile", default=EngineConfig.hardware_profile)
    profile = flags.parse_known_args(list(serve_args))[0].profile
    config = json.loads((model / "config.json").read_text())
    return CostModel(ModelShape.from_hf_config(config), load_profile(profile))


@dataclass
class TraceRun:
    """One trace's runs: ``NAME:QPS,QPS:SECONDS[:MAX_INPUT[:MAX_OUTPUT]]`` on the command line."""
    name: str
    qps: list[float]
    seconds: float
    max_input_len: int | None = None
    max_output_len: int | None = None

    @classmethod
    def parse(cls, text: str) -> TraceRun:
        parts = text.split(":")
        if not 3 <= len(parts) <= 5 or parts[0] not in TRACE_FILES:
            raise argparse.ArgumentTypeError(f"--trace {text!r}: use NAME:QPS,QPS:SECONDS[:MAX_INPUT"
                                             f"[:MAX_OUTPUT]] with NAME in {sorted(TRACE_FILES)}")
        try:
            qps = [float(q) for q in parts[1].split(",")]
            seconds = float(parts[2])
            caps = [int(c) if c else None for c in parts[3:]] + [None, None]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--trace {text!r}: {exc}") from exc
        if not all(0 < x < math.inf for x in (*qps, seconds)):  # nan made a traceback in num_requests
            raise argparse.ArgumentTypeError(f"--trace {text!r}: QPS and seconds must be positive and finite")
        if any(c is not None and c < 1 for c in caps):  # 0 read as "no cap"
            raise argparse.ArgumentTypeError(f"--trace {text!r}: MAX_INPUT and MAX_OUTPUT must be >= 1 (or empty)")
        return cls(parts[0], qps, seconds, caps[0], caps[1])

    def num_requests(self, qps: float) -> int:
        return max(1, math.ceil(qps * self.seconds))


LABEL = re.compile(r"[A-Za-z0-9._-]+")
"""What a configuration's label may be made of (it names files too)."""


@dataclass(frozen=True)
class Config:
    """One server configuration: ``label`` names it in every output (the table's and the JSON's
    ``policy``), ``policy`` is its ``serve --policy``, ``serve_args`` its other serve flags."""
    label: str
    policy: str
    serve_args: tuple[str, ...] = ()

    @classmethod
    def variant(cls, text: str) -> Config:
        """``LABEL=SERVE_ARGS`` (``--variant``); SERVE_ARGS holds ``--policy X`` exactly once."""
        label, sep, rest = (part.strip() for part in text.partition("="))
        if not sep or not LABEL.fullmatch(label):
            raise argparse.ArgumentTypeError(f"--variant {text!r}: use LABEL=SERVE_ARGS, LABEL non-empty "
                                             "and made of letters, digits, '-', '_' and '.'")
        try:
            words = iter(shlex.split(rest))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {exc}") from exc
        policies, others = [], []
        for word in words:
            if word == "--policy":
                policies.append(next(words, ""))
            elif word.startswith("--policy="):
                policies.append(word.partition("=")[2])
            else:
                others.append(word)
        if len(policies) != 1 or not policies[0] or policies[0].startswith("-"):
            raise argparse.ArgumentTypeError(f"--variant {text!r}: SERVE_ARGS must contain --policy X "
                                             "exactly once")
        return cls(label, policies[0], tuple(others))


def configurations(policies: str, variants: list[Config]) -> list[Config]:
    """The ``--policies`` (comma-separated, may be empty), then the ``--variant`` ones.

    Raises ValueError when there is none, or a label is malformed or not unique."""
    configs = [Config(p, p) for p in (p.strip() for p in policies.split(",")) if p] + variants
    labels = [c.label for c in configs]
    if not configs:
        raise ValueError("no configuration: give --policies or --variant")
    bad = [label for label in labels if not LABEL.fullmatch(label)]
    if bad:
        raise ValueError(f"--policies: malformed name(s) {bad}")
    dup = sorted({label for label in labels if labels.count(label) > 1})
    if dup:
        raise ValueError(f"configuration labels must be unique across --policies and --variant: {dup} repeated")
    return configs


def assign_lanes(configs: list[Config], n: int) -> list[list[Config]]:
    """Round-robin: configuration ``j`` runs in lane ``j % n``; lanes left empty are dropped."""
    return [configs[i::n] for i in range(min(n, len(configs)))]


# ---------------------------------------------------------------- summarising (CPU-tested)

def _add_ms_quantiles(out: dict[str, Any], key: str, seconds: list[float]) -> None:
    """Set ``out[key + "_median"]`` and ``out[key + "_p99"]`` (milliseconds) from ``seconds``, if any."""
    if seconds:
        seconds = sorted(seconds)
        out[key + "_median"] = seconds[len(seconds) // 2] * 1e3
        out[key + "_p99"] = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))] * 1e3


def iteration_summary(records: list[dict[str, Any]], t0: float, t1: float,
                      cost_model: Any = None) -> dict[str, Any]:
    """Iterations logged in ``[t0, t1]``: count, spatial share, plan shapes, prediction error.

    ``pred_err_median`` is the median of ``|predicted - measured| / measured`` over iterations
    with both times (the cost model's error on the real engine). For spatial iterations,
    ``spatial_measured_over_predicted`` is the median of measured / predicted iteration time,
    ``prefill_measured_over_predicted`` the median of the prefill stream's busy time over the
    predicted prefill time, and ``decode_step_measured_over_predicted`` the median of the decode
    stream's busy time per step over the predicted step time (None where not logged).
    Where the log has the scheduler's time (``schedule_s``, the policy's planning included),
    ``schedule_ms_median`` and ``schedule_ms_p99`` give it; where splits beside a prefill carry the
    host's timing (``launch_s``, ``handout_s``), ``launch_ms_*`` give when the prefill had been
    launched and ``first_handout_ms_*`` when the first decode step's tokens were handed out
    (milliseconds from the iteration's start, median and p99). Where spatial iterations carry the
    rates duet weighed (``trim_rates``: trimmed temporal, split), ``split_over_trimmed_rate_median``
    is the median of split / trimmed: how clearly the splits won. Where they carry the factor the
    decode side was priced with (``decode_margin``), ``decode_bias_by_sms`` maps each decode SM
    count to ``[median, count]`` of the decode step over its prediction with that factor divided
    out: the profile's own bias per level, which duet learns (``DuetPolicy.level_corrections``).
    Where iterations carry the GPU's busy span (``gpu_s`` of temporal plans; the decode stream's for
    multi-step decodes, the longer stream's for splits), ``host_idle_share`` is the share of the
    wall time (their ``measured_s`` plus the ``gap_s`` before them) in which the GPU waited for the
    host: their measured time less the span, plus the gaps; ``host_idle_in_iteration_share`` is
    its part inside the iterations (scheduling, inputs, the token read and outputs).
    With ``cost_model`` (the served model's ``CostModel``), ``eager_span_over_predicted`` is the
    median of the GPU span over the cost model's GPU time (``host=False``) of the temporal
    iterations with prefill that ran eagerly (more tokens than the logged ``piecewise_tokens``),
    ``eager_span_count`` their count: how far the served GPU time strays from the model's
    (1.14-1.20 on the H200, docs/benchmarks.md, thirty-third and thirty-fourth sessions).
    """
    its = [r for r in records if t0 <= r.get("t", -1.0) <= t1]
    spatial = [r for r in its if r.get("spatial")]
    errs = sorted(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in its
                  if r.get("predicted_s") is not None and r.get("measured_s"))
    out: dict[str, Any] = {"iterations": len(its), "spatial_iterations": len(spatial),
                           "spatial_share": len(spatial) / len(its) if its else None,
                           "pred_err_median": errs[len(errs) // 2] if errs else None}
    _add_ms_quantiles(out, "schedule_ms", [r["schedule_s"] for r in its if r.get("schedule_s") is not None])
    spanned = [(r, span) for r in its if (span := _gpu_span(r)) is not None and r.get("measured_s")]
    if spanned:
        wall = sum(r["measured_s"] + (r.get("gap_s") or 0.0) for r, _ in spanned)
        inside = sum(max(0.0, r["measured_s"] - span) for r, span in spanned)
        out["host_idle_in_iteration_share"] = inside / wall
        out["host_idle_share"] = (inside + sum(r.get("gap_s") or 0.0 for r, _ in spanned)) / wall
    if cost_model is not None:
        eager = [r for r in its if not r.get("spatial") and r.get("num_prefill_tokens") and r.get("gpu_s")
                 and r.get("requests") and sum(q for q, _ in r["requests"]) > (r.get("piecewise_tokens") or 0)]
        out["eager_span_count"] = len(eager)
        out["eager_span_over_predicted"] = _median_ratio(eager, lambda r: r["gpu_s"], lambda r: float(
            cost_model.predict_total(r["requests"], cost_model.profile.num_sms, graphs=False, host=False)))
    splits = [r for r in spatial if r.get("num_prefill_tokens")]
    _add_ms_quantiles(out, "launch_ms", [r["launch_s"] for r in splits if r.get("launch_s") is not None])
    _add_ms_quantiles(out, "first_handout_ms", [r["handout_s"][0] for r in splits if r.get("handout_s")])
    if spatial:
        sd = sorted(r["s_decode"] for r in spatial if r.get("s_decode") is not None)
        # decode steps run ("steps", at most the reserved "k"; older logs have only "k")
        ks = sorted(r.get("steps", r.get("k")) for r in spatial if r.get("steps", r.get("k")) is not None)
        out["s_decode_median"] = sd[len(sd) // 2] if sd else None
        out["k_median"] = ks[len(ks) // 2] if ks else None
        out["spatial_measured_over_predicted"] = _median_ratio(spatial, lambda r: r["measured_s"],
                                                              lambda r: r["predicted_s"])
        out["prefill_measured_over_predicted"] = _median_ratio(spatial, lambda r: r["prefill_stream_s"],
                                                              lambda r: r["predicted_prefill_s"])
        out["decode_step_measured_over_predicted"] = _median_ratio(
            [r for r in spatial if r.get("steps")], lambda r: r["decode_stream_s"] / r["steps"],
            lambda r: r["predicted_decode_s"])
        priced = [r for r in spatial if r.get("steps") and r.get("decode_margin") and r.get("decode_stream_s")
                  and r.get("predicted_decode_s")]
        if priced:
            out["decode_bias_by_sms"] = {
                s: [_median_ratio(level, lambda r: r["decode_stream_s"] / r["steps"] * r["decode_margin"],
                                  lambda r: r["predicted_decode_s"]), len(level)]
                for s in sorted({r["s_decode"] for r in priced})
                for level in [[r for r in priced if r["s_decode"] == s]]}
        weighed = [r for r in spatial if r.get("trim_rates")]
        if weighed:
            out["split_over_trimmed_rate_median"] = _median_ratio(weighed, lambda r: r["trim_rates"][1],
                                                                  lambda r: r["trim_rates"][0])
    return out


# late_gaps: how long after its iteration's log line a token may reach the client. A split's
# first step ends no sooner than this after the iteration before (host work and a step of
# 20 ms or more), so a late delivery of that iteration's tokens (the event loop, the GIL's
# 5 ms switch interval) is not blamed on the split.
LATE_MATCH_SLACK_S = 0.010


def late_gaps(result: dict[str, Any], records: list[dict[str, Any]], slo_s: float) -> dict[str, int]:
    """Where the gaps over the TBT SLO came from: each client gap longer than ``slo_s`` (the bench
    result's per-request ``itls_s``, placed in time from ``start_time_unix``, ``start_s`` and
    ``ttft_s``) is matched to the first logged iteration (``t``: its end, unix seconds) that ends
    after the token arrived, less ``LATE_MATCH_SLACK_S``: the one that produced it (heuristic:
    a split step shorter than the slack could be blamed on the iteration before).

    Returns counts: ``gaps`` (all), ``late``, and of the late ones ``temporal``, ``split_first_step``
    (the gap spans the iteration before, the host work before the first step and the step),
    ``split_later_step`` and ``unmatched`` (after the last logged iteration). A split's token is
    its first step's when it came before the second step's hand-out (the log's ``handout_s``);
    in older logs without it, when it came within 1.5 mean decode steps of the split's start
    (which counted a first step handed out late, as in the sixteenth session's call 2, as a
    later one). The fifteenth H200 session's runs, counted that older way, are in
    docs/benchmarks.md (Mooncake: mostly temporal iterations in one run, first steps in another).
    """
    ends = sorted((r["t"], i) for i, r in enumerate(records) if r.get("t") is not None)
    times = [t for t, _ in ends]
    out = {"gaps": 0, "late": 0, "temporal": 0, "split_first_step": 0, "split_later_step": 0, "unmatched": 0}
    t0 = result.get("start_time_unix", 0.0)
    for req in result.get("requests") or []:
        if req.get("ttft_s") is None:
            continue
        t = t0 + req.get("start_s", 0.0) + req["ttft_s"]
        for gap in req.get("itls_s") or []:
            t += gap
            out["gaps"] += 1
            if gap <= slo_s:
                continue
            out["late"] += 1
            k = bisect.bisect_left(times, t - LATE_MATCH_SLACK_S)
            if k == len(times):
                out["unmatched"] += 1
                continue
            r = records[ends[k][1]]
            if not r.get("spatial"):
                out["temporal"] += 1
                continue
            start = r["t"] - r.get("measured_s", 0.0)
            if r.get("handout_s"):
                first = len(r["handout_s"]) < 2 or t < start + r["handout_s"][1]
            else:
                first = t - start <= 1.5 * (r.get("decode_stream_s") or 0.0) / max(1, r.get("steps") or 1)
            out["split_first_step" if first else "split_later_step"] += 1
    return out


def _gpu_span(r: dict[str, Any]) -> float | None:
    """Seconds the GPU was busy in a logged iteration (``iteration_summary``), None where not logged."""
    if r.get("gpu_s") is not None:
        return r["gpu_s"]
    streams = [r.get("decode_stream_s"), r.get("prefill_stream_s")]
    return max((x for x in streams if x is not None), default=None)


def _median_ratio(records: list[dict[str, Any]], num: Any, den: Any) -> float | None:
    """Median of ``num(r) / den(r)`` over the records where both are logged and positive."""
    vals = []
    for r in records:
        try:
            a, b = num(r), den(r)
        except (KeyError, TypeError):
            continue
        if a and b:
            vals.append(a / b)
    vals.sort()
    return vals[len(vals) // 2] if vals else None


def run_row(run: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers of one run record (``None`` where the run has no result)."""
    res = run.get("result") or {}
    it = run.get("iterations") or {}
    return {
        "policy": run["policy"], "trace": run["trace"], "qps": run["qps"],
        "requests": run.get("num_requests"), "done": res.get("completed"), "failed": res.get("failed"),
        "req_s": res.get("request_throughput"), "out_tok_s": res.get("output_throughput"),
        "ttft_mean_ms": res.get("mean_ttft_ms"), "ttft_p99_ms": res.get("p99_ttft_ms"),
        "tbt_p50_ms": res.get("median_itl_ms"), "tbt_p99_ms": res.get("p99_itl_ms"),
        "slo_att": res.get("tbt_slo_attainment"), "spatial": it.get("spatial_share"),
        "pred_err": it.get("pred_err_median"), "status": run.get("status", "ok"),
    }


def _f(x: Any, fmt: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, fmt)


def _pct(x: Any, fmt: str) -> str:
    return "-" if x is None else format(100 * x, fmt) + "%"


def capacity(rows: list[dict[str, Any]], slo_ms: float, keep_up: float = 0.0) -> dict[tuple[str, str], dict]:
    """Per (trace, policy): the highest QPS with p99 TBT <= SLO, no failed request, and
    req/s >= ``keep_up`` x QPS, as ``{"qps", "req_s"}`` (``None``s if none).

    ``keep_up`` is 0 by default: runs of 10-20 s of arrivals count their drain in the duration,
    so req/s sits well under the QPS for every policy; overload shows as failed (timed-out)
    requests and in TTFT instead."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["trace"], r["policy"])
        best.setdefault(key, {"qps": None, "req_s": None})
        ok = (r["status"] == "ok" and r["tbt_p99_ms"] is not None and r["tbt_p99_ms"] <= slo_ms
              and not r["failed"] and r["req_s"] is not None and r["req_s"] >= keep_up * r["qps"])
        if ok and (best[key]["qps"] is None or r["qps"] > best[key]["qps"]):
            best[key] = {"qps": r["qps"], "req_s": r["req_s"]}
    return best


def format_table(runs: list[dict[str, Any]], slo_ms: float) -> str:
    """Markdown: one row per (trace, policy, QPS), then each policy's SLO capacity per trace."""
    rows = [run_row(r) for r in runs]
    head = ("| trace | policy | qps | done/sent | req/s | out tok/s | TTFT mean ms | TTFT p99 ms "
            "| TBT p50 ms | TBT p99 ms | SLO att. | spatial | pred err |")
    lines = [head, "|" + "---|" * 3 + "---:|" * 10]
    for r in sorted(rows, key=lambda r: (r["trace"], r["qps"], r["policy"])):
        done = f"{_f(r['done'], 'd')}/{_f(r['requests'], 'd')}" if r["status"] == "ok" else r["status"]
        lines.append(
            f"| {r['trace']} | {r['policy']} | {r['qps']:g} | {done} | {_f(r['req_s'], '.2f')} "
            f"| {_f(r['out_tok_s'], '.0f')} | {_f(r['ttft_mean_ms'], '.0f')} | {_f(r['ttft_p99_ms'], '.0f')} "
            f"| {_f(r['tbt_p50_ms'], '.1f')} | {_f(r['tbt_p99_ms'], '.1f')} "
            f"| {_pct(r['slo_att'], '.2f')} | {_pct(r['spatial'], '.1f')} | {_pct(r['pred_err'], '.0f')} |")
    cap = capacity(rows, slo_ms)
    lines += ["", f"Highest QPS run with p99 TBT <= {slo_ms:g} ms and no failed request (req/s there):"]
    for trace in sorted({t for t, _ in cap}):
        base = cap.get((trace, "chunked"), {}).get("req_s")
        parts = []
        for (t, policy), c in sorted(cap.items()):
            if t != trace:
                continue
            if c["qps"] is None:
                parts.append(f"{policy}: none")
                continue
            ratio = f", {c['req_s'] / base:.2f}x chunked" if base and policy != "chunked" else ""
            parts.append(f"{policy}: qps {c['qps']:g} ({c['req_s']:.2f} req/s{ratio})")
        lines.append(f"- {trace}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- running

def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001 - informational only
        env["torch"] = f"unavailable: {exc}"
    for mod in ("triton", "transformers", "fastapi", "uvicorn", "pydantic"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    try:  # the working tree's git tree hash: right even where the copy's .git is stale
        env["tree"] = subprocess.run(["bash", str(ROOT / "scripts" / "tree_id.sh")],
                                     capture_output=True, text=True, timeout=60).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["tree"] = None
    return env


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole: a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer in which token ``i`` is the word ``t{i}`` (unknown: ``<unk>``,
    id ``vocab_size``, which the model never samples).

    Needed because the server streams empty text without a tokenizer and ``duetserve bench``
    times only chunks that carry text: every sampled id now decodes to `` t{i}``, so each
    token is one timed chunk. Detokenizing costs the server what a real tokenizer would.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<unk>"] = vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "model_max_length": 1 << 20}))


def write_model(work: Path, name: str) -> Path:
    """A ``--model`` folder: config.json (dummy weights) and a synthetic word-level tokenizer."""
    if name == "qwen3-8b":
        from duetserve.calibrate.workload import QWEN3_8B
        config = dict(QWEN3_8B)
    elif name == "tiny":
        config = dict(TINY_QWEN3)
    else:
        raise ValueError(f"unknown model config {name!r}")
    config.setdefault("torch_dtype", "bfloat16")
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(folder, config["vocab_size"])
    return folder


@dataclass
class Lane:
    """Configurations run one after another, each with its own server on ``port``; ``gpu`` is
    the servers' ``CUDA_VISIBLE_DEVICES`` (``None``: the environment's, with one lane)."""
    index: int
    configs: list[Config]
    port: int
    gpu: int | None
    slice_end: float = math.inf
    """End of the running configuration's time slice (``time.monotonic()``)."""


class Bench:
    """The benchmark: lanes run in parallel threads; ``lock`` guards ``runs``, ``servers``,
    ``iter_logs``, the server records' fields and the files ``save`` writes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t_start = time.monotonic()
        self.out = Path(args.out)
        self.work = Path(args.work)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.runs: list[dict[str, Any]] = []
        self.servers: list[dict[str, Any]] = []
        self.iter_logs: dict[str, Path] = {}
        self.env: dict[str, Any] = {}
        self.cost_models: dict[str, Any] = {}  # label: the served model's, for the iteration summary
        self.slo_ms = args.tbt_slo_ms
        self.lanes = [Lane(i, configs, args.port + i, i if args.gpus > 1 else None)
                      for i, configs in enumerate(assign_lanes(args.configs, args.gpus))]

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t_start)

    def log(self, msg: str, lane: Lane | None = None) -> None:
        tag = f"[lane {lane.index}] " if lane is not None else ""
        with self.lock:
            print(f"[{time.monotonic() - self.t_start:6.1f}s] {tag}{msg}", flush=True)

    def note(self, record: dict[str, Any], **fields: Any) -> None:
        """Set fields of a record ``save`` may be writing from another lane."""
        with self.lock:
            record.update(fields)

    def bench_cmd(self, port: int, extra: list[str], result: Path) -> list[str]:
        return [sys.executable, "-m", "duetserve.bench", "--base-url", f"http://127.0.0.1:{port}",
                "--endpoint", "/v1/completions", "--tbt-slo", f"{self.slo_ms:g}ms", "--no-progress",
                "--seed", str(self.args.seed), "--result-file", str(result), *extra]

    def run_bench(self, cmd: list[str], limit_s: float, lane: Lane) -> tuple[int | None, str]:
        self.log("$ " + " ".join(cmd[1:]), lane)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"")
            return None, out.decode(errors="replace") if isinstance(out, bytes) else out
        return p.returncode, p.stdout + p.stderr

    def server_cmd(self, cfg: Config, model: Path, iter_log: Path, lane: Lane) -> str:
        """The serve command line (split with shlex and run without a shell by ServerProcess,
        which cannot pass an environment: the lane's GPU is set through ``env``)."""
        a = self.args
        cmd = (f"{sys.executable} -m duetserve.cli serve --model {model} --load-format dummy --port {lane.port} "
               f"--tbt-slo {self.slo_ms:g}ms --policy {cfg.policy} --iteration-log {iter_log} --seed {a.seed}")
        if lane.gpu is not None:
            cmd = f"env CUDA_VISIBLE_DEVICES={lane.gpu} {cmd}"
        if a.device:
            cmd += f" --device {a.device}"
        return " ".join([cmd, *map(shlex.quote, cfg.serve_args), *([a.serve_args] if a.serve_args else [])])

    def run_lane(self, lane: Lane, model: Path) -> None:
        """The lane's configurations in turn, each with an equal share of the time left."""
        for i, cfg in enumerate(lane.configs):
            self.one_config(lane, cfg, model, share=1.0 / (len(lane.configs) - i))

    def one_config(self, lane: Lane, cfg: Config, model: Path, share: float = 1.0) -> None:
        """Start the server, warm up, run each (trace, QPS), stop; ``share`` of the time left is
        this configuration's slice (a run that would end past it is skipped, so later ones run too)."""
        from duetserve.bench.launch import LaunchConfig, ServerProcess

        a = self.args
        label = cfg.label
        iter_log = self.work / f"iterations_{label}.jsonl"
        iter_log.unlink(missing_ok=True)
        server_log = self.work / f"server_{label}.log"
        info: dict[str, Any] = {"policy": label, "lane": lane.index, "port": lane.port,
                                "command": self.server_cmd(cfg, model, iter_log, lane)}
        with self.lock:
            self.iter_logs[label] = iter_log
            self.servers.append(info)
        lane.slice_end = time.monotonic() + share * self.left()
        # QPS levels interleaved across traces, so a short slice still covers every trace
        pending = [(tr, tr.qps[i]) for i in range(max(len(tr.qps) for tr in a.trace))
                   for tr in a.trace if i < len(tr.qps)]
        if self.left() < a.launch_reserve_s:
            self.note(info, status="skipped: out of time before start")
            self._skip(label, pending, info["status"])
            return
        self.log(f"=== {label}: starting server", lane)
        t0 = time.monotonic()
        server = ServerProcess(LaunchConfig(info["command"], f"http://127.0.0.1:{lane.port}/health",
                                            startup_timeout_s=max(10.0, min(a.launch_timeout_s, self.left() - 20)),
                                            stop_timeout_s=15.0, log_path=server_log))
        try:
            server.__enter__()
        except (RuntimeError, TimeoutError, OSError) as exc:
            self.note(info, status=f"server failed: {type(exc).__name__}", error=str(exc)[-3000:])
            self.log(f"{label}: {info['status']}\n{info['error']}", lane)
            self._skip(label, pending, info["status"])
            return
        self.note(info, startup_s=round(time.monotonic() - t0, 1))
        self.log(f"{label}: healthy after {info['startup_s']} s", lane)
        try:
            if a.warmup_requests > 0 and self.left() > 30:
                t1 = time.monotonic()
                rc, text = self.run_bench(self.bench_cmd(lane.port, [
                    "--num-requests", str(a.warmup_requests), "--input-len", a.warmup_input_len,
                    "--output-len", a.warmup_output_len, "--qps", str(a.warmup_qps),
                    "--request-timeout", "120s"], self.work / f"warmup_{label}.json"),
                    min(150.0, self.left() - 20), lane)
                self.note(info, warmup_s=round(time.monotonic() - t1, 1), warmup_rc=rc)
                self.log(f"{label}: warm-up rc={rc} in {info['warmup_s']} s", lane)
                if rc != 0:
                    self.log(text[-2000:], lane)
            for i, (tr, qps) in enumerate(pending):
                self.one_run(lane, label, tr, qps, iter_log, first=i == 0)
        finally:
            server.stop()
            self.note(info, log_tail=server.log_tail()[-4000:])
            self.save()

    def add_runs(self, *runs: dict[str, Any]) -> None:
        """Record finished runs and rewrite the files."""
        with self.lock:
            self.runs.extend(runs)
            self.save()

    def _skip(self, label: str, pending: list[tuple[TraceRun, float]], why: str) -> None:
        self.add_runs(*({"policy": label, "trace": tr.name, "qps": qps, "status": why,
                         "num_requests": tr.num_requests(qps)} for tr, qps in pending))

    def one_run(self, lane: Lane, label: str, tr: TraceRun, qps: float, iter_log: Path,
                first: bool = False) -> None:
        a = self.args
        n = tr.num_requests(qps)
        run: dict[str, Any] = {"policy": label, "trace": tr.name, "qps": qps, "num_requests": n,
                               "seconds": tr.seconds, "max_input_len": tr.max_input_len,
                               "max_output_len": tr.max_output_len}
        limit = tr.seconds + a.request_timeout_s + 30
        need = tr.seconds + a.drain_estimate_s
        slice_left = lane.slice_end - time.monotonic()
        if self.left() < min(limit, need) or (not first and slice_left < need):
            run["status"] = "skipped: out of time"
            self.log(f"{label} {tr.name} qps {qps:g}: {run['status']} ({slice_left:.0f} s left in this "
                     f"configuration's slice, {self.left():.0f} s in all, {need:.0f} s needed)", lane)
            self.add_runs(run)
            return
        fname, fmt = TRACE_FILES[tr.name]
        result = self.work / f"{label}_{tr.name}_qps{qps:g}.json"
        result.unlink(missing_ok=True)
        extra = ["--trace", str(Path(a.traces_dir) / fname), "--trace-format", fmt, "--arrival", "poisson",
                 "--qps", f"{qps:g}", "--num-requests", str(n), "--request-timeout", f"{a.request_timeout_s:g}s"]
        if tr.max_input_len:
            extra += ["--max-input-len", str(tr.max_input_len)]
        if tr.max_output_len:
            extra += ["--max-output-len", str(tr.max_output_len)]
        cmd = self.bench_cmd(lane.port, extra, result)
        run["command"] = " ".join(cmd[1:])
        rc, text = self.run_bench(cmd, min(limit, self.left() - 5), lane)
        run["rc"] = rc
        if rc is None or not result.is_file():
            run["status"] = "timeout" if rc is None else f"bench failed rc={rc}"
            run["bench_output_tail"] = text[-2000:]
            self.log(f"{label} {tr.name} qps {qps:g}: {run['status']}\n{text[-2000:]}", lane)
        else:
            res = json.loads(result.read_text())
            run["status"] = "ok"
            run["result"] = res
            t0 = res["start_time_unix"]
            records = _read_jsonl(iter_log)
            run["iterations"] = iteration_summary(records, t0, t0 + res["duration"], self.cost_models.get(label))
            run["late_gaps"] = late_gaps(res, records, a.tbt_slo_ms / 1e3)
            r = run_row(run)
            self.log(f"{label} {tr.name} qps {qps:g}: done {r['done']}/{n} failed {r['failed']}, "
                     f"{_f(r['req_s'], '.2f')} req/s, TBT p50/p99 {_f(r['tbt_p50_ms'], '.1f')}/"
                     f"{_f(r['tbt_p99_ms'], '.1f')} ms, SLO att {_f(r['slo_att'], '.4f')}, "
                     f"spatial {_f(r['spatial'], '.3f')}", lane)
            it = run["iterations"]
            if it.get("spatial_iterations"):
                self.log(f"  spatial iterations, measured / predicted (median): whole "
                         f"{_f(it['spatial_measured_over_predicted'], '.2f')}, prefill stream "
                         f"{_f(it['prefill_measured_over_predicted'], '.2f')}, decode step "
                         f"{_f(it['decode_step_measured_over_predicted'], '.2f')}; split / trimmed "
                         f"token rate (median) {_f(it.get('split_over_trimmed_rate_median'), '.3f')}", lane)
            late = run["late_gaps"]
            if late["late"]:
                self.log(f"  gaps over the SLO: {late['late']} of {late['gaps']}: "
                         f"{late['split_first_step'] + late['split_later_step']} in splits "
                         f"({late['split_first_step']} on their first step), {late['temporal']} in temporal "
                         f"iterations, {late['unmatched']} after the log", lane)
            if it.get("decode_bias_by_sms"):
                self.log("  decode step / the profile's prediction by decode SMs (median, count): " + ", ".join(
                    f"{s}: {_f(m, '.2f')} ({n})" for s, (m, n) in it["decode_bias_by_sms"].items()), lane)
            if it.get("host_idle_share") is not None:
                self.log(f"  host time with the GPU idle: {it['host_idle_share']:.1%} of the wall time "
                         f"({it['host_idle_in_iteration_share']:.1%} inside iterations, the rest between them)", lane)
            if it.get("eager_span_count"):
                self.log(f"  eager iterations with prefill, GPU span / the cost model's GPU time (median): "
                         f"{_f(it['eager_span_over_predicted'], '.3f')} ({it['eager_span_count']})", lane)
            if it.get("schedule_ms_median") is not None:
                self.log(f"  scheduling a step (planning included), ms p50/p99: {it['schedule_ms_median']:.2f}/"
                         f"{it['schedule_ms_p99']:.2f}", lane)
            if it.get("launch_ms_median") is not None:
                self.log(f"  splits, ms from the start, p50/p99: prefill launched {it['launch_ms_median']:.1f}/"
                         f"{it['launch_ms_p99']:.1f}, first step handed out {_f(it.get('first_handout_ms_median'), '.1f')}"
                         f"/{_f(it.get('first_handout_ms_p99'), '.1f')}", lane)
            if res.get("failure_reasons"):
                self.log(f"  failures: {json.dumps(res['failure_reasons'])[:600]}", lane)
        self.add_runs(run)

    def save(self) -> None:
        """Rewrite serving.json, serving_table.md and iterations.jsonl.gz (each replaced whole), as strict JSON."""
        from duetserve.jsonio import dumps

        with self.lock:
            settings = {k: [asdict(x) for x in v] if isinstance(v, list) and v and is_dataclass(v[0]) else v
                        for k, v in vars(self.args).items()}
            doc = {"settings": settings, "environment": self.env,
                   "elapsed_s": round(time.monotonic() - self.t_start, 1),
                   "servers": self.servers, "runs": self.runs}
            _replace(self.out / "serving.json", dumps(doc).encode())
            _replace(self.out / "serving_table.md", format_table(self.runs, self.slo_ms).encode())
            lines = [dumps({"policy": label, **rec}) + "\n"
                     for label, path in self.iter_logs.items() for rec in _read_jsonl(path)]
            _replace(self.out / "iterations.jsonl.gz", gzip.compress("".join(lines).encode()))

    def plots(self) -> None:
        from duetserve.bench.plot import plot_results, read_iteration_log

        spatial: dict[str, list[float]] = {}  # per configuration: lanes run servers at the same time
        for label, path in self.iter_logs.items():
            if path.is_file():
                try:
                    spatial[label] = read_iteration_log(path)
                except ValueError:
                    pass
        for tr in self.args.trace:
            done = [r for r in self.runs if r["trace"] == tr.name and r.get("status") == "ok"]
            if not done:
                continue
            top = {}
            for r in done:  # highest QPS each configuration finished
                if r["policy"] not in top or r["qps"] > top[r["policy"]]["qps"]:
                    top[r["policy"]] = r
            runs = list(top.values())
            try:
                plot_results([r["result"] for r in runs], [f"{r['policy']} qps {r['qps']:g}" for r in runs],
                             self.out / f"serving_{tr.name}.png",
                             spatial_by_result=[spatial.get(r["policy"], []) for r in runs])
            except Exception as exc:  # noqa: BLE001 - a plot must not lose the numbers
                self.log(f"plot {tr.name} failed: {type(exc).__name__}: {exc}")

    def run_lanes(self, model: Path) -> None:
        """Every lane in its own thread; an error in one is raised once all have ended."""
        with ThreadPoolExecutor(len(self.lanes)) as pool:
            futures = [pool.submit(self.run_lane, lane, model) for lane in self.lanes]
        for f in futures:
            f.result()

    def main(self) -> int:
        from duetserve.bench.launch import stop_servers_on_sigterm

        stop_servers_on_sigterm(hard=True)  # a `timeout` on the device call must not leave servers behind
        a = self.args
        self.env = _environment()
        self.log(f"environment: {json.dumps(self.env)}")
        for lane in self.lanes:
            gpu = "" if lane.gpu is None else f", CUDA_VISIBLE_DEVICES={lane.gpu}"
            self.log(f"{', '.join(c.label for c in lane.configs)} (port {lane.port}{gpu})", lane)
        model = write_model(self.work, a.model_config)
        extra = shlex.split(a.serve_args) if a.serve_args else []
        try:
            self.cost_models = {c.label: served_cost_model(model, [*c.serve_args, *extra]) for c in a.configs}
        except (ValueError, OSError) as exc:
            print(f"serving_bench: a configuration's --profile does not load: {exc}", file=sys.stderr)
            return 2
        self.run_lanes(model)
        self.plots()
        self.save()
        self.log(f"done in {time.monotonic() - self.t_start:.0f} s\n")
        print(format_table(self.runs, self.slo_ms))
        return 0 if any(r.get("status") == "ok" for r in self.runs) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--work", default="/tmp/duetserve-serving", help="server logs, per-run JSON, model folder")
    p.add_argument("--model-config", default="qwen3-8b", choices=("qwen3-8b", "tiny"))
    p.add_argument("--device", default=None, help="passed to serve --device")
    p.add_argument("--policies", default="duet,chunked,prefill-first,pdmux",
                   help="comma-separated serve policies, one configuration each (may be empty)")
    p.add_argument("--variant", type=Config.variant, action="append", default=[], metavar="LABEL=SERVE_ARGS",
                   help="one more configuration, labelled LABEL, served with SERVE_ARGS (which hold "
                        "--policy X), e.g. 'duet-trim=--policy duet --trim-margin 0.85'; repeatable")
    p.add_argument("--gpus", type=int, default=1,
                   help="lanes run in parallel: configuration j in lane j %% N, whose servers see "
                        "CUDA_VISIBLE_DEVICES=j %% N (when N > 1) and listen on --port + j %% N")
    p.add_argument("--trace", type=TraceRun.parse, action="append", required=True,
                   metavar="NAME:QPS,QPS:SECONDS[:MAX_INPUT[:MAX_OUTPUT]]",
                   help="runs of one trace: Poisson QPS levels, seconds of arrivals each, input cap")
    p.add_argument("--traces-dir", default=str(ROOT / ".traces"),
                   help="folder of the trace files (scripts/copy_traces.sh fills the default)")
    p.add_argument("--tbt-slo-ms", type=float, default=100.0)
    p.add_argument("--port", type=int, default=8123, help="lane i's servers listen on PORT + i")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="extra flags for duetserve serve")
    p.add_argument("--request-timeout-s", type=float, default=40.0,
                   help="per request; bounds the drain of an overloaded run")
    p.add_argument("--deadline-s", type=float, default=500.0,
                   help="the whole benchmark's time budget (each lane's: lanes run in parallel)")
    p.add_argument("--drain-estimate-s", type=float, default=12.0,
                   help="expected time after the last arrival of a run (skip runs that cannot fit)")
    p.add_argument("--launch-timeout-s", type=float, default=240.0)
    p.add_argument("--launch-reserve-s", type=float, default=60.0,
                   help="do not start another server with less time left than this")
    p.add_argument("--warmup-requests", type=int, default=6)
    p.add_argument("--warmup-input-len", default="1000:9000")
    p.add_argument("--warmup-output-len", default="24")
    p.add_argument("--warmup-qps", type=float, default=3.0)
    return p


def missing_traces(folder: Path, runs: list[TraceRun]) -> list[str]:
    """The files of ``runs``' traces (``TRACE_FILES``) that ``folder`` lacks, each once, in order."""
    names = dict.fromkeys(TRACE_FILES[run.name][0] for run in runs)
    return [name for name in names if not (folder / name).is_file()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``configs`` (the configurations in order) added."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gpus < 1:
        parser.error(f"--gpus {args.gpus}: must be >= 1")
    # found only after a server had started (minutes on a GPU)
    if not Path(args.traces_dir).is_dir():
        parser.error(f"--traces-dir {args.traces_dir}: no such folder (scripts/copy_traces.sh fills .traces)")
    if missing := missing_traces(Path(args.traces_dir), args.trace):
        parser.error(f"--traces-dir {args.traces_dir}: no {', '.join(missing)} (scripts/copy_traces.sh copies them)")
    try:
        args.configs = configurations(args.policies, args.variant)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    return Bench(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
