"""``duetserve calibrate``: measure BW(S), Pi(S) and the served model's iteration latencies on
this machine's GPU, write a hardware profile, and report the cost model's prediction error.

The profile (``--out``) has the schema of ``duetserve/planner/profiles/*.json``; load it with
``--profile PATH`` (serve) or ``--gpu PATH`` (simulate). Unmeasured fields come from
``--base``. The per-kernel overheads ``kernel_gpu_s`` and ``launch_cpu_s`` are fitted to the
measured iteration latencies, with the engine's kernel counts (``duetserve.calibrate.overhead``).
Its ``"calibration"`` list keeps each measured iteration with its predictions. Prints the
median and p90 relative error ``|pred - meas| / meas`` for prefill and decode: the roofline
before the fit, the calibrated profile after it, the held-out shapes before and after a fit
on the other shapes, and the base profile; ``--plot`` draws predicted against measured.

``--refit CALIBRATED.json [...]`` instead fits ``gemm_efficiency`` and the per-kernel overheads
again, on ``--base``'s ``Pi(S)`` and ``BW(S)``, to the iterations calibrations on a GPU measured
(pooled; ``runner.refit_calibration``), needs no GPU, and writes ``--base`` with them (and the re-predicted
rows); the report and ``--plot`` as above, without the curves.

``--iteration-log LOG [LOG ...]`` instead fits the serving host time (``host_per_request_s``,
``host_eager_s``, ``host_piecewise_s``, and between iterations ``host_gap_s`` and
``host_gap_per_request_s``; ``duetserve.calibrate.host``) to the iteration logs
(pooled; ``.gz`` read gzipped) of servers that planned with ``--base`` (``--repredict``: with another
profile; their iterations are re-predicted with ``--base`` first), needs no GPU, and writes
``--base`` with the terms the logs' iterations fit replaced.

Exit status: 0 on success (failed single measurements are listed); 2 on bad usage: a bad flag,
or flags that do not go together (the message names the flag); 1 on any other error (no GPU, an
iteration log that does not fit, a profile that cannot be written); 130 when interrupted (Ctrl-C).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

from duetserve.argtypes import (
    UsageError,
    argtype,
    existing_file,
    exit_status,
    non_empty,
    output_file,
    plot_file,
    write_output,
)
from duetserve.calibrate.host import fit_gap, fit_host_overheads, gap_summary, read_iteration_log, repredict
from duetserve.calibrate.overhead import EFFICIENCY_GRID, OverheadFit
from duetserve.calibrate.report import (
    format_curves,
    format_errors,
    format_rows,
    plot_predictions,
)
from duetserve.calibrate.runner import Calibration, Options, refit_calibration, run_calibration
from duetserve.calibrate.workload import QWEN3_8B
from duetserve.config import ATTENTION_BACKENDS
from duetserve.jsonio import dumps
from duetserve.partition.base import BACKENDS as PARTITION_BACKENDS
from duetserve.planner.cost_model import ModelShape
from duetserve.planner.hardware import HardwareProfile, available_profiles, load_profile


def _model_path(text: str) -> Path:
    path = Path(text)
    if not (path / "config.json" if path.is_dir() else path).is_file():
        raise argparse.ArgumentTypeError(f"{text} is neither a config.json nor a folder holding one")
    return path


def _cuda_device(text: str) -> str:
    """``--device``: ``cuda`` or ``cuda:N``; else "must be cuda or cuda:N, got 'TEXT'" (torch's own
    error came after the argument checks, exit 1, or a CPU device failed inside the measurement)."""
    if not re.fullmatch(r"cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be cuda or cuda:N, got {text!r}")
    return text


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add every ``duetserve calibrate`` option to ``p``."""
    p.add_argument("--gpu-name", required=True, type=non_empty, metavar="NAME", help="name of the profile written")
    p.add_argument("--out", required=True, type=output_file, metavar="PROFILE.json", help="profile to write")
    p.add_argument("--base", type=argtype(load_profile), default="h200", metavar="NAME|PATH",
                   help=f"profile of the unmeasured fields and baseline of the comparison: "
                        f"{', '.join(available_profiles())} or a JSON file (default h200)")
    p.add_argument("--model", type=_model_path, metavar="CONFIG_OR_FOLDER",
                   help="served model: a config.json (dummy weights) or a Hugging Face folder "
                        "(default: Qwen3-8B shapes)")
    p.add_argument("--load-format", choices=("dummy", "auto"), default="dummy",
                   help="dummy: random bf16 weights (default); auto: the folder's weights")
    p.add_argument("--partition-backend", choices=PARTITION_BACKENDS, default="greenctx",
                   help="streams of S SMs for BW(S), Pi(S) and split decode (none: all SMs only)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    p.add_argument("--device", type=_cuda_device, default="cuda", help="cuda or cuda:N")
    p.add_argument("--plot", type=plot_file, metavar="OUT.png", help="draw predicted against measured")
    p.add_argument("--quick", action="store_true",
                   help="8 timed repeats instead of 20, one decode batch on split SM levels")
    p.add_argument("--iteration-log", type=existing_file, nargs="+", metavar="LOG.jsonl",
                   help="fit only the serving host time to these `serve --iteration-log` files (pooled; .gz "
                        "read gzipped) of servers that planned with --base (no GPU needed)")
    p.add_argument("--repredict", action="store_true",
                   help="with --iteration-log: re-predict the logged iterations with --base first (logs of "
                        "servers that planned with another profile; --model gives the model, default Qwen3-8B)")
    p.add_argument("--refit", type=existing_file, nargs="+", metavar="CALIBRATED.json",
                   help="fit gemm_efficiency and the per-kernel overheads again, on --base's curves, to the "
                        "iterations calibrations measured (profiles calibrate wrote on a GPU, rows pooled; no GPU "
                        "needed)")


def model_folder(args: argparse.Namespace, scratch: Path) -> tuple[Path, ModelShape]:
    """The folder the engine loads and the model's shape: ``--model``'s folder, or ``scratch``
    holding ``--model``'s config.json (or Qwen3-8B's when ``--model`` is not given).

    Raises UsageError when a bare config.json is given with ``--load-format auto``.
    """
    if args.model is not None and args.model.is_dir():
        return args.model, ModelShape.from_hf_config(json.loads((args.model / "config.json").read_text()))
    if args.load_format != "dummy":
        raise UsageError("--load-format auto needs --model FOLDER with weights")
    config = QWEN3_8B if args.model is None else json.loads(args.model.read_text())
    (scratch / "config.json").write_text(json.dumps(config))
    return scratch, ModelShape.from_hf_config(config)


def _fitted(fit: OverheadFit) -> str:
    floor = fit.gemm_efficiency <= min(EFFICIENCY_GRID)  # nothing lower tried: the roofline cannot reach them
    return (f"kernel_gpu_s {fit.kernel_gpu_s * 1e6:.2f} us, launch_cpu_s {fit.launch_cpu_s * 1e6:.2f} us, "
            f"gemm_efficiency {fit.gemm_efficiency:.2f}"
            + (" (the lowest tried: are the iterations of another model than the one priced, --model?)"
               if floor else ""))


def fit_summary(result: Calibration) -> str:
    """The kernel counts, the fitted overheads (every shape, and the fit half) and which shapes
    were held out, or why nothing was fitted."""
    if result.fit is None or result.holdout_fit is None:
        return "per-kernel overheads: not fitted (no kernel count or no measured iteration; see the failures)"
    counts = ", ".join(f"{kind} {per_layer} per layer + {outside}" for kind, (per_layer, outside)
                       in (result.kernel_counts or {}).items())
    held = [f"{r['kind']} {r['batch']}x{r['q'] + r['c']} @{r['sms']}" for r in result.rows if r.get("split") == "holdout"]
    return "\n".join([
        f"kernels per iteration: {counts}",
        f"per-kernel overheads and GEMM efficiency (written to the profile, fitted on all {len(result.rows)} "
        f"shapes): {_fitted(result.fit)}",
        f"fit half ({len(result.rows) - len(held)} shapes): {_fitted(result.holdout_fit)}",
        "held out (every second shape of each group): " + ", ".join(held)])


def report(result: Calibration, base: HardwareProfile) -> str:
    """The printed summary: measured curves (if any) beside the base profile's, shapes, errors,
    failures."""
    sms = sorted(s for curve in result.curves.values() for s in curve if s <= base.num_sms)
    parts = ["BW(S) and Pi(S) measured (base: " + base.name + ")",
             format_curves(result.curves, {s: float(base.bandwidth(s)) for s in sms},
                           {s: float(base.compute_rate(s)) for s in sms}), ""] if result.curves else []
    parts += ["iteration latency, measured and predicted", format_rows(result.rows),
             "", "relative error |pred - meas| / meas", format_errors(result.rows), "", fit_summary(result)]
    if result.skipped:
        parts += ["", "skipped (do not fit):", *result.skipped]
    if result.errors:
        parts += ["", f"{len(result.errors)} measurements FAILED:", *result.errors]
    return "\n".join(parts)


def _ms(seconds: float | None, name: str) -> str:
    return f"{name} {seconds * 1e3:.2f} ms" if seconds is not None else f"{name} not fitted (no such iterations)"


def fit_host(args: argparse.Namespace) -> int:
    """``--iteration-log``: fit the host terms, write the profile; 0, or 1 on an error."""
    logs = " ".join(map(str, args.iteration_log))
    try:
        shape = _model_shape(args) if args.repredict else None
    except UsageError as exc:
        return exit_status("calibrate", exc)
    records = []
    for path in args.iteration_log:
        try:
            logged = read_iteration_log(path)
        except (ValueError, OSError) as exc:  # its message names the file
            print(f"duetserve calibrate: error: --iteration-log: {exc}", file=sys.stderr)
            return 1
        try:
            records += repredict(logged, shape, args.base) if shape else logged
        except ValueError as exc:  # "record N: ..."
            print(f"duetserve calibrate: error: --iteration-log {path}: {exc}", file=sys.stderr)
            return 1
    try:
        fit = fit_host_overheads(records, args.base)
    except ValueError as exc:
        print(f"duetserve calibrate: error: --iteration-log {logs}: {exc}", file=sys.stderr)
        return 1
    gap = fit_gap(records)
    fields = {k: v for k, v in (("host_per_request_s", fit.host_per_request_s), ("host_eager_s", fit.host_eager_s),
                                ("host_piecewise_s", fit.host_piecewise_s),
                                ("host_gap_s", gap and gap[0]), ("host_gap_per_request_s", gap and gap[1]))
              if v is not None}
    profile = dataclasses.replace(args.base, name=args.gpu_name, **fields,
                                  provenance={**args.base.provenance, **dict.fromkeys(fields, "measured")})
    try:
        write_output(args.out, dumps(dataclasses.asdict(profile), indent=1) + "\n", "--out")
    except OSError as exc:  # "--out PATH: REASON"
        print(f"duetserve calibrate: error: {exc}", file=sys.stderr)
        return 1
    print(f"host time fitted on {fit.rows} temporal iterations of {logs}: "
          f"host_per_request_s {fit.host_per_request_s * 1e3:.3f} ms"
          f"{'' if fit.per_request_fitted else ' (kept: no single-step decode-only iteration logged)'}, "
          f"{_ms(fit.host_eager_s, 'host_eager_s')}, "
          f"{_ms(fit.host_piecewise_s, 'host_piecewise_s')}\n"
          f"median |pred - meas| / meas: {100 * fit.median_error_before:.1f}% as logged, "
          f"{100 * fit.median_error_after:.1f}% with the fitted terms\nprofile: {args.out}")
    if (gaps := gap_summary(records)) is not None:  # not priced: the iterations' own time only
        print(f"host time between iterations (gap_s) on {gaps.count} iterations: median "
              f"{gaps.median_s * 1e3:.2f} ms, p90 {gaps.p90_s * 1e3:.2f} ms, {100 * gaps.share:.1f}% of their own time")
    if gap is not None:
        print(f"fitted (duet's budget and the simulator; not in iteration predictions): "
              f"host_gap_s {gap[0] * 1e3:.3f} ms + host_gap_per_request_s {gap[1] * 1e6:.2f} us a request of the "
              "iteration before")
    return 0


def _print_result(args: argparse.Namespace, result: Calibration, title_suffix: str = "") -> int:
    """Print the report (and draw ``--plot``) of a calibration written to ``--out``; 0."""
    print(report(result, args.base))
    print(f"\nprofile: {args.out}")
    if args.plot:
        plot_predictions(result.rows, args.plot,
                         f"{args.gpu_name}: predicted vs measured iteration latency{title_suffix}")
        print(f"plot: {args.plot}")
    return 0


def _model_shape(args: argparse.Namespace) -> ModelShape:
    """The served model's shape for the modes without a GPU (``model_folder``).

    Raises UsageError "--model PATH: ..." for a config it cannot read."""
    try:
        with tempfile.TemporaryDirectory() as scratch:
            return model_folder(args, Path(scratch))[1]
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--model {args.model}: {exc}") from exc


def refit(args: argparse.Namespace) -> int:
    """``--refit``: fit again on ``--base``'s curves, write the profile, print the report; 0, or 1
    (2 for a usage error) on an error."""
    calibrated = []
    for path in args.refit:
        try:
            calibrated.append(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            print(f"duetserve calibrate: error: --refit {path}: not JSON ({exc})", file=sys.stderr)
            return 1
        except OSError as exc:
            return exit_status("calibrate", exc)
    try:
        shape = _model_shape(args)
        result = refit_calibration(calibrated, args.base, shape, args.gpu_name)
    except UsageError as exc:
        return exit_status("calibrate", exc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # not a calibrated profile's layout
        what = f"a calibration row has no {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"duetserve calibrate: error: --refit {' '.join(map(str, args.refit))}: {what}", file=sys.stderr)
        return 1
    profile = {**dataclasses.asdict(result.profile), "calibration": result.rows}
    try:  # in place, as --iteration-log writes (a rename would replace a link or a device)
        write_output(args.out, dumps(profile, indent=1) + "\n", "--out")
    except OSError as exc:  # "--out PATH: REASON"
        return exit_status("calibrate", exc)
    return _print_result(args, result, " (refit)")


def run(args: argparse.Namespace) -> int:
    """Run ``duetserve calibrate`` with parsed arguments; 0 on success, 2 on a usage error, 1 on any
    other error (printed to stderr)."""
    if args.repredict and not args.iteration_log:
        print("duetserve calibrate: error: --repredict goes with --iteration-log", file=sys.stderr)
        return 2
    if args.iteration_log or args.refit:
        # flags of the GPU measurement mean nothing here: refused, not ignored (--plot wrote nothing)
        mode = "--iteration-log" if args.iteration_log else "--refit"
        allowed = {"--refit": {"--refit", "--model", "--plot"},
                   "--iteration-log": {"--repredict", "--model"} if args.repredict else set()}[mode]
        unused = [flag for flag, value, default in (
            ("--refit", args.refit, None), ("--model", args.model, None), ("--load-format", args.load_format, "dummy"),
            ("--partition-backend", args.partition_backend, "greenctx"), ("--attention-backend", args.attention_backend, "auto"),
            ("--device", args.device, "cuda"), ("--plot", args.plot, None), ("--quick", args.quick, False))
            if value != default and flag not in allowed]
        if unused:
            print(f"duetserve calibrate: error: {', '.join(unused)} {'do' if len(unused) > 1 else 'does'} not go "
                  f"with {mode}", file=sys.stderr)
            return 2
        return fit_host(args) if args.iteration_log else refit(args)
    try:
        from duetserve.model.fused_ops import fused_mode
        from duetserve.model.layers import decode_gemm_mode

        decode_gemm_mode()  # checked before minutes of measuring, not at the model's graph capture
        fused_mode()
        with tempfile.TemporaryDirectory() as scratch:
            folder, shape = model_folder(args, Path(scratch))
            from duetserve.calibrate.gpu import CudaBench

            bench = CudaBench(args.partition_backend, args.device, 8 if args.quick else 20, args.attention_backend)
            opts = Options(args.gpu_name, args.out, args.base, folder, shape, args.load_format, args.quick)
            result = run_calibration(bench, opts)
    except (ValueError, RuntimeError, OSError) as exc:
        return exit_status("calibrate", exc)
    return _print_result(args, result)
