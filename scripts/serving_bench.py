"""Serving benchmark through the HTTP server: every policy x trace x QPS in one process budget.

For each policy it starts ``python3 -m duetserve.cli serve`` once (dummy weights, iteration
log on; the same start/stop code as ``duetserve bench --launch``), sends a short warm-up (so
Triton compiles before anything is timed), then runs ``python3 -m duetserve.bench`` once per
(trace, QPS) against it: Poisson arrivals re-drawn at the QPS over the trace's first
``ceil(QPS x seconds)`` requests (the simulator's setting in docs/benchmarks.md), input
lengths capped where asked. One server per policy instead of one per bench call halves the
start-up cost, which a 10-minute device call cannot spare.

Everything lands in ``--out`` as at most six files, rewritten after every run so a kill
leaves what was done: ``serving.json`` (settings, environment, per-run metrics with spatial
share and predicted-vs-measured iteration error, and each run's full bench result),
``serving_table.md``, ``serving_<trace>.png`` (one per trace, the highest QPS, all policies)
and ``iterations.jsonl.gz`` (the servers' iteration logs, with ``policy``). The caller's log
is the sixth. A global deadline (``--deadline-s``) skips what no longer fits.

Used by scripts/device_serving.sh (GPU, and its CPU smoke mode).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRACE_FILES = {
    "azure_code": ("AzureLLMInferenceTrace_code.csv", "azure"),
    "mooncake": ("mooncake_conversation_trace.jsonl", "mooncake"),
}

TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32768, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "eos_token_id": 2}
"""A tiny Qwen3 for the CPU smoke run (vocabulary above bench's default token-id range 1000:32000)."""


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
        if not qps or min(qps) <= 0 or seconds <= 0:
            raise argparse.ArgumentTypeError(f"--trace {text!r}: QPS and seconds must be positive")
        return cls(parts[0], qps, seconds, caps[0], caps[1])

    def num_requests(self, qps: float) -> int:
        return max(1, math.ceil(qps * self.seconds))


# ---------------------------------------------------------------- summarising (CPU-tested)

def iteration_summary(records: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Iterations logged in ``[t0, t1]``: count, spatial share, plan shapes, prediction error.

    ``pred_err_median`` is the median of ``|predicted - measured| / measured`` over iterations
    with both times (the cost model's error on the real engine).
    """
    its = [r for r in records if t0 <= r.get("t", -1.0) <= t1]
    spatial = [r for r in its if r.get("spatial")]
    errs = sorted(abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in its
                  if r.get("predicted_s") is not None and r.get("measured_s"))
    out: dict[str, Any] = {"iterations": len(its), "spatial_iterations": len(spatial),
                           "spatial_share": len(spatial) / len(its) if its else None,
                           "pred_err_median": errs[len(errs) // 2] if errs else None}
    if spatial:
        sd = sorted(r["s_decode"] for r in spatial if r.get("s_decode") is not None)
        # decode steps run ("steps", at most the reserved "k"; older logs have only "k")
        ks = sorted(r.get("steps", r.get("k")) for r in spatial if r.get("steps", r.get("k")) is not None)
        out["s_decode_median"] = sd[len(sd) // 2] if sd else None
        out["k_median"] = ks[len(ks) // 2] if ks else None
    return out


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
    try:
        env["commit"] = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%H %cd"],
                                       capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = None
    return env


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


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t_start = time.monotonic()
        self.out = Path(args.out)
        self.work = Path(args.work)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.runs: list[dict[str, Any]] = []
        self.servers: list[dict[str, Any]] = []
        self.iter_logs: dict[str, Path] = {}
        self.env = _environment()
        self.slo_ms = args.tbt_slo_ms
        self.slice_end = time.monotonic() + args.deadline_s

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t_start)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t_start:6.1f}s] {msg}", flush=True)

    def bench_cmd(self, extra: list[str], result: Path) -> list[str]:
        return [sys.executable, "-m", "duetserve.bench", "--base-url", f"http://127.0.0.1:{self.args.port}",
                "--endpoint", "/v1/completions", "--tbt-slo", f"{self.slo_ms:g}ms", "--no-progress",
                "--seed", str(self.args.seed), "--result-file", str(result), *extra]

    def run_bench(self, cmd: list[str], limit_s: float) -> tuple[int | None, str]:
        self.log("$ " + " ".join(cmd[1:]))
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"")
            return None, out.decode(errors="replace") if isinstance(out, bytes) else out
        return p.returncode, p.stdout + p.stderr

    def server_cmd(self, policy: str, model: Path, iter_log: Path) -> str:
        a = self.args
        cmd = (f"{sys.executable} -m duetserve.cli serve --model {model} --load-format dummy --port {a.port} "
               f"--tbt-slo {self.slo_ms:g}ms --policy {policy} --iteration-log {iter_log} --seed {a.seed}")
        if a.device:
            cmd += f" --device {a.device}"
        return cmd + (" " + a.serve_args if a.serve_args else "")

    def one_policy(self, policy: str, model: Path, share: float = 1.0) -> None:
        """Start the server, warm up, run each (trace, QPS), stop; ``share`` of the time left is
        this policy's slice (a run that would end past it is skipped, so later policies run too)."""
        from duetserve.bench.launch import LaunchConfig, ServerProcess

        a = self.args
        iter_log = self.work / f"iterations_{policy}.jsonl"
        iter_log.unlink(missing_ok=True)
        self.iter_logs[policy] = iter_log
        server_log = self.work / f"server_{policy}.log"
        info: dict[str, Any] = {"policy": policy, "command": self.server_cmd(policy, model, iter_log)}
        self.servers.append(info)
        self.slice_end = time.monotonic() + share * self.left()
        # QPS levels interleaved across traces, so a short slice still covers every trace
        pending = [(tr, tr.qps[i]) for i in range(max(len(tr.qps) for tr in a.trace))
                   for tr in a.trace if i < len(tr.qps)]
        if self.left() < a.launch_reserve_s:
            info["status"] = "skipped: out of time before start"
            self._skip(policy, pending, info["status"])
            return
        self.log(f"=== {policy}: starting server")
        t0 = time.monotonic()
        server = ServerProcess(LaunchConfig(info["command"], f"http://127.0.0.1:{a.port}/health",
                                            startup_timeout_s=max(10.0, min(a.launch_timeout_s, self.left() - 20)),
                                            stop_timeout_s=15.0, log_path=server_log))
        try:
            server.__enter__()
        except (RuntimeError, TimeoutError, OSError) as exc:
            info["status"] = f"server failed: {type(exc).__name__}"
            info["error"] = str(exc)[-3000:]
            self.log(f"{policy}: {info['status']}\n{info['error']}")
            self._skip(policy, pending, info["status"])
            return
        info["startup_s"] = round(time.monotonic() - t0, 1)
        self.log(f"{policy}: healthy after {info['startup_s']} s")
        try:
            if a.warmup_requests > 0 and self.left() > 30:
                t1 = time.monotonic()
                rc, text = self.run_bench(self.bench_cmd(
                    ["--num-requests", str(a.warmup_requests), "--input-len", a.warmup_input_len,
                     "--output-len", a.warmup_output_len, "--qps", str(a.warmup_qps),
                     "--request-timeout", "120s"], self.work / "warmup.json"), min(150.0, self.left() - 20))
                info["warmup_s"] = round(time.monotonic() - t1, 1)
                info["warmup_rc"] = rc
                self.log(f"{policy}: warm-up rc={rc} in {info['warmup_s']} s")
                if rc != 0:
                    self.log(text[-2000:])
            for i, (tr, qps) in enumerate(pending):
                self.one_run(policy, tr, qps, iter_log, first=i == 0)
        finally:
            server.stop()
            info["log_tail"] = server.log_tail()[-4000:]
            self.save()

    def _skip(self, policy: str, pending: list[tuple[TraceRun, float]], why: str) -> None:
        for tr, qps in pending:
            self.runs.append({"policy": policy, "trace": tr.name, "qps": qps, "status": why,
                              "num_requests": tr.num_requests(qps)})
        self.save()

    def one_run(self, policy: str, tr: TraceRun, qps: float, iter_log: Path, first: bool = False) -> None:
        a = self.args
        n = tr.num_requests(qps)
        run: dict[str, Any] = {"policy": policy, "trace": tr.name, "qps": qps, "num_requests": n,
                               "seconds": tr.seconds, "max_input_len": tr.max_input_len,
                               "max_output_len": tr.max_output_len}
        self.runs.append(run)
        limit = tr.seconds + a.request_timeout_s + 30
        need = tr.seconds + a.drain_estimate_s
        slice_left = self.slice_end - time.monotonic()
        if self.left() < min(limit, need) or (not first and slice_left < need):
            run["status"] = "skipped: out of time"
            self.log(f"{policy} {tr.name} qps {qps:g}: {run['status']} ({slice_left:.0f} s left in this "
                     f"policy's slice, {self.left():.0f} s in all, {need:.0f} s needed)")
            self.save()
            return
        fname, fmt = TRACE_FILES[tr.name]
        result = self.work / f"{policy}_{tr.name}_qps{qps:g}.json"
        result.unlink(missing_ok=True)
        extra = ["--trace", str(Path(a.traces_dir) / fname), "--trace-format", fmt, "--arrival", "poisson",
                 "--qps", f"{qps:g}", "--num-requests", str(n), "--request-timeout", f"{a.request_timeout_s:g}s"]
        if tr.max_input_len:
            extra += ["--max-input-len", str(tr.max_input_len)]
        if tr.max_output_len:
            extra += ["--max-output-len", str(tr.max_output_len)]
        run["command"] = " ".join(self.bench_cmd(extra, result)[1:])
        rc, text = self.run_bench(self.bench_cmd(extra, result), min(limit, self.left() - 5))
        run["rc"] = rc
        if rc is None or not result.is_file():
            run["status"] = "timeout" if rc is None else f"bench failed rc={rc}"
            run["bench_output_tail"] = text[-2000:]
            self.log(f"{policy} {tr.name} qps {qps:g}: {run['status']}\n{text[-2000:]}")
        else:
            res = json.loads(result.read_text())
            run["status"] = "ok"
            run["result"] = res
            t0 = res["start_time_unix"]
            run["iterations"] = iteration_summary(_read_jsonl(iter_log), t0, t0 + res["duration"])
            r = run_row(run)
            self.log(f"{policy} {tr.name} qps {qps:g}: done {r['done']}/{n} failed {r['failed']}, "
                     f"{_f(r['req_s'], '.2f')} req/s, TBT p50/p99 {_f(r['tbt_p50_ms'], '.1f')}/"
                     f"{_f(r['tbt_p99_ms'], '.1f')} ms, SLO att {_f(r['slo_att'], '.4f')}, "
                     f"spatial {_f(r['spatial'], '.3f')}")
            if res.get("failure_reasons"):
                self.log(f"  failures: {json.dumps(res['failure_reasons'])[:600]}")
        self.save()

    def save(self) -> None:
        a = self.args
        doc = {"settings": {k: (v if not isinstance(v, list) or not v or not isinstance(v[0], TraceRun)
                                else [vars(t) for t in v]) for k, v in vars(a).items()},
               "environment": self.env, "elapsed_s": round(time.monotonic() - self.t_start, 1),
               "servers": self.servers, "runs": self.runs}
        tmp = self.out / "serving.json.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.out / "serving.json")
        table = format_table(self.runs, self.slo_ms)
        (self.out / "serving_table.md").write_text(table)
        with gzip.open(self.out / "iterations.jsonl.gz", "wt") as f:
            for policy, path in self.iter_logs.items():
                for rec in _read_jsonl(path):
                    f.write(json.dumps({"policy": policy, **rec}) + "\n")

    def plots(self) -> None:
        from duetserve.bench.plot import plot_results, read_iteration_log

        spatial: list[float] = []
        for path in self.iter_logs.values():
            if path.is_file():
                try:
                    spatial += read_iteration_log(path)
                except ValueError:
                    pass
        for tr in self.args.trace:
            done = [r for r in self.runs if r["trace"] == tr.name and r.get("status") == "ok"]
            if not done:
                continue
            top = {}
            for r in done:  # highest QPS each policy finished
                if r["policy"] not in top or r["qps"] > top[r["policy"]]["qps"]:
                    top[r["policy"]] = r
            runs = list(top.values())
            try:
                plot_results([r["result"] for r in runs], [f"{r['policy']} qps {r['qps']:g}" for r in runs],
                             self.out / f"serving_{tr.name}.png", spatial)
            except Exception as exc:  # noqa: BLE001 - a plot must not lose the numbers
                self.log(f"plot {tr.name} failed: {type(exc).__name__}: {exc}")

    def main(self) -> int:
        a = self.args
        self.log(f"environment: {json.dumps(self.env)}")
        model = write_model(self.work, a.model_config)
        policies = a.policies.split(",")
        for i, policy in enumerate(policies):
            self.one_policy(policy, model, share=1.0 / (len(policies) - i))
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
    p.add_argument("--policies", default="duet,chunked,prefill-first,pdmux")
    p.add_argument("--trace", type=TraceRun.parse, action="append", required=True,
                   metavar="NAME:QPS,QPS:SECONDS[:MAX_INPUT]",
                   help="runs of one trace: Poisson QPS levels, seconds of arrivals each, input cap")
    p.add_argument("--traces-dir", default=str(ROOT / ".traces"))
    p.add_argument("--tbt-slo-ms", type=float, default=100.0)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="extra flags for duetserve serve")
    p.add_argument("--request-timeout-s", type=float, default=40.0,
                   help="per request; bounds the drain of an overloaded run")
    p.add_argument("--deadline-s", type=float, default=500.0, help="the whole benchmark's time budget")
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


def main(argv: list[str] | None = None) -> int:
    return Bench(build_parser().parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
