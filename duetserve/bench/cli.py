"""duetserve bench: replay a trace (or synthetic load) against an OpenAI-compatible server.

Prints a vllm bench serve-style table per run; --result-file R.json saves the metrics
(vLLM's keys), the run's settings and per-request records. With --sweep-qps each load is
one run and one file, R_qps{Q}.json (e.g. R_qps2.json), and --plot overlays all loads in
one image.

Exit status:
  0  every run completed at least one request (failed requests are counted in its report)
  1  setup error: unreadable files, server not reachable or not starting
     ("duetserve bench: error: ..." on stderr)
  2  every request of a run failed (the reports are still printed, and saved with
     --result-file); 2 is also argparse's status for a usage error: a bad flag, flags
     that do not go together, or a --trace file that is no trace ("duetserve bench:
     error: ..." naming the flag, on stderr)
  130  interrupted (Ctrl-C); a --launch server is stopped first
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shlex
import shutil
import sys
from dataclasses import fields, is_dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from duetserve.argtypes import (
    UsageError,
    add_length_options,
    argtype,
    arrival_cv,
    comma_items,
    existing_file,
    exit_status,
    finite_non_negative,
    non_empty,
    non_negative_int,
    number,
    output_file,
    pair,
    plot_file,
    positive_duration,
    positive_int,
    rate,
    rates,
    read_trace,
    tbt_slo,
    trace_format,
    window,
    write_output,
)
from duetserve.bench.launch import (
    LaunchConfig,
    ServerProcess,
    launched_base_url,
    stop_servers_on_sigterm,
)
from duetserve.bench.metrics import (
    Slos,
    compute_metrics,
    format_comparison,
    format_report,
)
from duetserve.bench.plot import plot_results, read_iteration_log
from duetserve.bench.prompts import Tokenizer
from duetserve.bench.runner import BenchConfig, BenchRun, run_benchmark
from duetserve.config import parse_duration
from duetserve.jsonio import dumps, json_safe
from duetserve.traces import TraceSpec

_GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str]) -> Slos:
    """Goodput SLOs from ``KEY:VALUE`` items, KEY in ttft/tpot/e2el, VALUE a duration whose
    bare numbers are milliseconds (as in vLLM's ``--goodput ttft:200``).

    Raises:
        UsageError: an unknown key, a repeated key, or a bad or zero value.
    """
    slos: dict[str, float] = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in _GOODPUT_KEYS or key in slos:
            raise UsageError(f"--goodput {item}: keys are {', '.join(_GOODPUT_KEYS)}, each once")
        try:
            slos[key] = parse_duration(value, "ms")
        except ValueError as exc:
            raise UsageError(f"--goodput {item}: {exc}") from exc
        if not slos[key] > 0:  # no request meets it: a goodput of 0 whatever the server does
            raise UsageError(f"--goodput {item}: must be a positive duration")
    return Slos(**{f"{k}_s": v for k, v in slos.items()})


def _percentiles(text: str) -> list[float]:
    values = [number(x, float) for x in comma_items(text)]
    if not values or not all(0 <= v <= 100 for v in values):
        raise ValueError(f"expected percentiles in [0, 100], e.g. 90,99, got {text!r}")
    return values


def _token_id_range(text: str) -> tuple[int, int]:
    low, high = pair(text, lambda x: number(x, int), "LOW:HIGH")
    if not 0 <= low < high:
        raise ValueError(f"expected 0 <= LOW < HIGH, got {text!r}")
    return low, high



_RESULT_KEYS = ("completed", "duration", "requests")
"""Keys every saved result has (``_build_result``), checked by ``load_result``."""


def load_result(path: Path) -> dict[str, Any]:
    """A result saved by ``duetserve bench --result-file``.

    Raises:
        ValueError: "PATH is not a bench JSON result: REASON" (bad JSON, not an object, a missing key).
        OSError: the file cannot be read.
    """
    try:
        result = json.loads(path.read_text())
    except ValueError as exc:  # bad JSON or UTF-8
        raise ValueError(f"{path} is not a bench JSON result: {exc}") from exc
    if not isinstance(result, dict):
        raise ValueError(f"{path} is not a bench JSON result: a JSON {type(result).__name__}, not an object")
    if missing := [k for k in _RESULT_KEYS if k not in result]:
        raise ValueError(f"{path} is not a bench JSON result: no {', '.join(map(repr, missing))}")
    return result


def _result_input(text: str) -> Path:
    """``--compare``: an existing file holding a saved result (see ``load_result``)."""
    path = existing_file(text)
    load_result(path)
    return path


def _iteration_log(text: str) -> Path:
    """``--iteration-log``: an existing file, or one a ``--launch`` server can create (in an existing,
    writable folder; ``_check_iteration_log`` asks for the file itself without ``--launch``)."""
    path = Path(text)
    return path if path.is_file() else output_file(text)


def _check_iteration_log(args: argparse.Namespace) -> None:
    """Raise UsageError naming ``--iteration-log`` when it names no readable file and no ``--launch``
    server can write it during the run (it is read only after the run, for ``--plot``)."""
    path = args.iteration_log
    if path is None or args.launch:
        return
    if not path.is_file():
        raise UsageError(f"--iteration-log {path}: no such file (only a --launch server can write it during the run)")
    try:
        open(path).close()
    except OSError as exc:
        raise UsageError(f"--iteration-log {path}: {exc.strerror}") from exc


def _check_trace_flags(args: argparse.Namespace) -> None:
    """Raise UsageError naming the flags when ``--trace`` and ``--trace-format`` give no trace, a
    synthetic trace lacks ``--num-requests`` or a rate, or ``--arrival`` and the rate or ``--cv`` do
    not go together; set ``args.cv`` to its value (``arrival_cv``)."""
    fmt = trace_format(args.trace, args.trace_format, "--trace-format")
    args.cv = arrival_cv(args.cv, fmt, args.arrival)
    rate = args.qps is not None or bool(args.sweep_qps)
    if fmt == "synthetic" and (args.num_requests is None or not rate):
        raise UsageError("a synthetic trace needs a number of requests and a QPS (--num-requests and --qps)")
    if fmt != "synthetic" and args.arrival == "trace" and rate:
        raise UsageError("--qps and --sweep-qps need --arrival scale or poisson for a trace file "
                         "(--arrival trace, the default, keeps the trace's own arrival times)")
    if args.arrival != "trace" and not rate:
        raise UsageError(f"--arrival {args.arrival} needs --qps or --sweep-qps")


def _existing_folder(text: str) -> str:
    if not Path(text).is_dir():
        raise ValueError(f"no such folder: {text}")
    return text


def _command(text: str) -> str:
    """A ``--launch`` command line whose program exists (split as ``ServerProcess`` splits it).
    ``duetserve`` not on the PATH (bench run as ``.venv/bin/duetserve`` without activating the
    environment) becomes the ``duetserve`` beside this interpreter, when there is one."""
    words = shlex.split(text)
    if not words:
        raise ValueError("empty command")
    if shutil.which(words[0]) is None:
        beside = Path(sys.executable).parent / "duetserve"
        if words[0] != "duetserve" or shutil.which(str(beside)) is None:
            raise ValueError(f"command not found: {words[0]}")
        return shlex.join([str(beside), *words[1:]])
    return text


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add every ``duetserve bench`` option to ``p``."""
    t = p.add_argument_group("trace")
    t.add_argument("--trace", type=existing_file, metavar="FILE",
                   help="trace file (Azure .csv or Mooncake .jsonl); omit for synthetic")
    t.add_argument("--trace-format", default="auto",
                   choices=["auto", "azure", "mooncake", "synthetic"])
    t.add_argument("--arrival", default="trace", choices=["trace", "scale", "poisson"],
                   help="trace: keep timestamps; scale: stretch to --qps; poisson: re-draw at "
                        "--qps with gamma gaps of CV --cv (default: trace)")
    t.add_argument("--qps", type=rate, help="request rate, req/s ('inf': all at once)")
    t.add_argument("--cv", type=finite_non_negative,
                   help="CV of generated inter-arrival gaps: --arrival poisson, or synthetic (default 1 = Poisson)")
    t.add_argument("--window", type=window,
                   metavar="START:END", help="keep arrivals in [START, END) s of the trace")
    t.add_argument("--num-requests", type=positive_int, metavar="N",
                   help="first N requests (synthetic: how many)")
    t.add_argument("--max-input-len", type=positive_int, metavar="TOKENS", help="cap prompt lengths")
    t.add_argument("--max-output-len", type=positive_int, metavar="TOKENS", help="cap output lengths")
    add_length_options(t)
    t.add_argument("--seed", type=non_negative_int, default=0, help="seed for lengths, arrivals and prompts")

    s = p.add_argument_group("server")
    s.add_argument("--base-url", type=argtype(_server_url), metavar="URL",
                   help="server root (default: http://HOST:PORT of --launch's --host and --port, as "
                        "vLLM's and SGLang's benchmarks take --host and --port; else http://127.0.0.1:8000)")
    s.add_argument("--endpoint", default="/v1/completions", type=argtype(_endpoint),
                   help="/v1/completions (token-id prompts) or /v1/chat/completions (text)")
    s.add_argument("--model", help="model name (default: first id of /v1/models)")
    s.add_argument("--api-key", type=non_empty, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--max-concurrency", type=positive_int, help="most requests in flight")
    s.add_argument("--request-timeout", type=positive_duration("s"), default=600.0,
                   metavar="DURATION", help="limit per request (default 600s)")
    s.add_argument("--tokenizer", type=argtype(_existing_folder), metavar="PATH",
                   help="tokenizer (HF folder) that chat text prompts are checked against")
    s.add_argument("--token-id-range", type=argtype(_token_id_range),
                   default=(1000, 32000), metavar="LOW:HIGH",
                   help="ids of token-id prompts are drawn from [LOW, HIGH) (default 1000:32000)")
    s.add_argument("--launch", type=argtype(_command), metavar="CMD",
                   help="start this server command first (it must listen at --base-url, which defaults "
                        "to its --host and --port), wait for /health, stop it after")
    s.add_argument("--launch-timeout", type=positive_duration("s"), default=600.0,
                   metavar="DURATION", help="longest wait for /health (default 600s)")
    s.add_argument("--launch-log", type=output_file, metavar="PATH",
                   help="server output file (default: a temporary file, deleted unless the server or the run fails)")

    r = p.add_argument_group("results")
    r.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="goodput SLOs, e.g. ttft:500 tpot:100ms e2el:10s (bare numbers: ms)")
    r.add_argument("--tbt-slo", type=tbt_slo,
                   metavar="DURATION", help="TBT SLO for tbt_slo_attainment, e.g. 100ms")
    r.add_argument("--percentiles", type=argtype(_percentiles), default=[90.0, 99.0],
                   metavar="P,P", help="reported percentiles (default 90,99)")
    r.add_argument("--result-file", type=output_file, metavar="PATH",
                   help="save results as JSON (with --sweep-qps: one PATH_qps{Q}.json per load)")
    r.add_argument("--sweep-qps", type=rates, metavar="Q,Q,...",
                   help="one run per rate (needs --arrival scale|poisson for trace files)")
    r.add_argument("--plot", type=plot_file, metavar="PNG", help="draw TTFT/TBT CDFs, TBT over time")
    r.add_argument("--iteration-log", type=argtype(_iteration_log), metavar="JSONL",
                   help='server iteration log {"t": unix_s, "spatial": bool} to mark in --plot; read after the '
                        "run (a --launch server may write it)")
    r.add_argument("--compare", nargs=2, type=argtype(_result_input), metavar=("A.json", "B.json"),
                   help="print two saved results side by side (no run)")
    r.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _load_tokenizer(path: str) -> Tokenizer:
    """A Hugging Face tokenizer from a local folder (transformers is imported only if needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _spec_json(spec: TraceSpec) -> dict[str, Any]:
    """``spec`` as JSON values: length distributions by their repr."""
    return {f.name: repr(v) if is_dataclass(v := getattr(spec, f.name)) else v for f in fields(spec)}


def _build_result(args: argparse.Namespace, spec: TraceSpec, outcome: BenchRun,
                  slos: Slos) -> dict[str, Any]:
    """The saved JSON: settings, vLLM-style metrics, then per-request records; ``jsonio.json_safe``
    (an infinite rate is ``"inf"``)."""
    return json_safe({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model_id": outcome.model,
        "trace": str(args.trace) if args.trace else None,
        "trace_spec": _spec_json(spec),
        "num_prompts": len(outcome.records),
        "request_rate": spec.qps,
        "max_concurrency": args.max_concurrency,
        "goodput_slo_ms": {k: v * 1000 for k in _GOODPUT_KEYS
                           if (v := getattr(slos, f"{k}_s")) is not None} or None,
        "start_time_unix": outcome.start_time_unix,
        **compute_metrics(outcome.records, outcome.duration_s, slos, args.percentiles),
        "requests": [r.to_json() for r in outcome.records],
    })


def _result_path(path: Path, qps: float | None, sweep: bool) -> Path:
    """``path``, or ``STEM_qps{Q}.SUFFIX`` for one load of a sweep."""
    return path.with_name(f"{path.stem}_qps{qps:g}{path.suffix}") if sweep else path


_COMPARE_FLAGS = ("compare", "plot", "iteration_log", "no_progress")
"""Destinations of the flags that matter with ``--compare`` (``--no-progress`` does nothing there, harmlessly)."""


def _check_compare_flags(args: argparse.Namespace) -> None:
    """Raise UsageError naming the flags given with ``--compare`` (different from their defaults) that
    only matter when running a benchmark: they were ignored."""
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    defaults = vars(parser.parse_args([]))
    ignored = [f"--{dest.replace('_', '-')}" for dest, default in defaults.items()
               if dest not in _COMPARE_FLAGS and getattr(args, dest) != default]
    if ignored:
        raise UsageError(f"{', '.join(ignored)}: only when running a benchmark, not with --compare "
                         "(which prints two saved results)")


def _compare(args: argparse.Namespace) -> int:
    _check_compare_flags(args)
    _check_iteration_log(args)
    a, b = (load_result(p) for p in args.compare)
    print(format_comparison(a, b, (args.compare[0].stem, args.compare[1].stem)))
    if args.plot:
        plot_results([a, b], [p.stem for p in args.compare], args.plot, _spatial_times(args))
        print(f"plot: {args.plot}")
    return 0


def _spatial_times(args: argparse.Namespace) -> list[float]:
    """The spatial iterations' times from ``--iteration-log`` (none without it); errors name the flag."""
    if not args.iteration_log:
        return []
    try:
        return read_iteration_log(args.iteration_log)
    except OSError as exc:
        raise ValueError(f"--iteration-log {args.iteration_log}: {exc.strerror}") from exc
    except ValueError as exc:
        raise ValueError(f"--iteration-log {exc}") from exc


def _base_url(args: argparse.Namespace) -> str:
    """``--base-url``; without it, where the ``--launch`` server listens (its ``--host`` and ``--port``:
    a server launched on another port was polled at :8000 until ``--launch-timeout``), or 127.0.0.1:8000."""
    if args.base_url is not None:
        return args.base_url
    try:
        return launched_base_url(args.launch or "")
    except ValueError as exc:  # "its --port 0 is not a port ..."
        raise UsageError(f"--launch {args.launch}: {exc}") from exc


def _bench(args: argparse.Namespace) -> int:
    if args.sweep_qps and args.qps is not None:
        raise UsageError("give either --qps or --sweep-qps")
    args.base_url = _base_url(args)
    _check_trace_flags(args)
    _check_iteration_log(args)
    slos = replace(parse_goodput(args.goodput), tbt_s=args.tbt_slo)
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    config = BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
        token_id_range=args.token_id_range,
        progress=not args.no_progress,
    )
    spec = TraceSpec(
        format=args.trace_format, arrival=args.arrival, qps=args.qps, cv=args.cv,
        window_s=args.window, num_requests=args.num_requests,
        max_input_len=args.max_input_len, max_output_len=args.max_output_len,
        input_len=args.input_len, output_len=args.output_len, seed=args.seed,
    )
    loads = args.sweep_qps or [args.qps]
    specs = [replace(spec, qps=q) for q in loads]
    traces = [read_trace(args.trace, s) for s in specs]
    server: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if args.launch:
        server = ServerProcess(LaunchConfig(
            args.launch, args.base_url.rstrip("/") + "/health",
            startup_timeout_s=args.launch_timeout, log_path=args.launch_log,
        ))
    results = []
    if args.launch:
        stop_servers_on_sigterm()
    with server:
        for qps, spec_q, trace in zip(loads, specs, traces):
            print(f"duetserve bench: {len(trace)} requests, rate {qps or 'from trace'} req/s, "
                  f"{config.base_url}{config.endpoint}", file=sys.stderr)
            outcome = asyncio.run(run_benchmark(trace, config, tokenizer))
            result = _build_result(args, spec_q, outcome, slos)
            results.append(result)
            print(format_report(result, f"Serving Benchmark Result (qps {qps or 'trace'})"))
            if args.result_file:
                path = _result_path(args.result_file, qps, bool(args.sweep_qps))
                write_output(path, dumps(result), "--result-file")
                print(f"results: {path}")
    if args.plot:
        labels = [f"qps {q:g}" if q else "trace timing" for q in loads]
        plot_results(results, labels, args.plot, _spatial_times(args))
        print(f"plot: {args.plot}")
    empty = [f"{q:g}" if q else "trace timing" for q, r in zip(loads, results) if r["completed"] == 0]
    if empty:
        print(f"duetserve bench: every request failed at qps {', '.join(empty)} (reasons in the report)",
              file=sys.stderr)
        return 2
    return 0


def _server_url(text: str) -> str:
    """``--base-url``: an http:// or https:// URL with a host, e.g. ``http://127.0.0.1:8000``
    ("notaurl" and "ftp://x" failed after the run's header, in httpx), and not ending in ``/v1``
    (the OpenAI SDK's base URL: requests went to ``/v1/v1/...`` and failed with a 404)."""
    url = urlsplit(text)
    try:
        url.port  # noqa: B018 -- raises ValueError for a port that is no number in [0, 65535]
        valid = url.scheme in ("http", "https") and bool(url.hostname)
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(f"expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:8000, got {text!r}")
    if url.path.rstrip("/").endswith("/v1"):  # the OpenAI SDK's base_url; --endpoint carries the /v1
        root = text.rstrip("/")[:-len("/v1")]
        raise ValueError(f"give the server root without /v1 (--endpoint adds it), e.g. {root}, got {text!r}")
    return text


def _endpoint(text: str) -> str:
    """A path on the server: ``/v1/completions`` ("v1/completions" made an invalid URL)."""
    if not text.startswith("/"):
        raise ValueError(f"must be a path starting with '/', e.g. /v1/completions, got {text!r}")
    return text


def run(args: argparse.Namespace) -> int:
    """Run ``duetserve bench`` with parsed arguments.

    Returns:
        0 when every run produced a report with at least one completed request (some may
        have failed), 1 on a setup error (server not reachable or not starting), 2 on a
        usage error (bad flags or a bad --trace file, named in the message) or when every
        request of a run failed (the reports are still written).
    """
    for name in ("httpx", "httpcore"):  # one INFO line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        return _compare(args) if args.compare else _bench(args)
    except (ValueError, RuntimeError, TimeoutError, OSError) as e:
        return exit_status("bench", e)
