"""``duetserve simulate``: replay a trace through the engine's scheduler on the cost model's clock.

One simulation per (policy, QPS): the trace's requests keep their lengths and get arrivals at
each QPS (Poisson by default). Prints one table row per (policy, QPS), then per policy the
highest swept QPS whose p99 TBT stays within the SLO while finished requests keep up with the
offered load (``report.slo_capacity``), and its request throughput relative to ``chunked``;
with no such QPS, which condition failed at each (``report.capacity_misses``).
``--json`` saves the rows, ``--plot`` draws TBT, TTFT and throughput against QPS.
Exit status: 0 on success; 2 on bad usage: a bad flag, flags that do not go together or do not
fit the trace or the model, or a --trace file that is no trace (the message names the flag); 1 on
any other error; 130 when interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from duetserve import argtypes
from duetserve.argtypes import UsageError, trace_format
from duetserve.config import BLOCK_SIZES, CUDA_TOKEN_BUDGET, POLICIES, EngineConfig
from duetserve.engine.policy import policy_by_name
from duetserve.jsonio import dumps
from duetserve.partition.base import BACKENDS as PARTITION_BACKENDS
from duetserve.planner.cost_model import ModelShape
from duetserve.planner.hardware import available_profiles, load_profile
from duetserve.planner.policies import PlannerConfig
from duetserve.sim.report import format_capacity, format_table, plot_rows, summarize
from duetserve.sim.simulator import SimConfig, simulate
from duetserve.traces import TraceRequest, TraceSpec


def _fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = argtypes.number(text, float)
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {text!r}")
    return value


def _sigma(text: str) -> float:
    """A lognormal sigma in [0, 1] (1 already puts the p99 factor near 10x; 1000 overflowed)."""
    value = argtypes.number(text, float)
    if not 0 <= value <= 1:
        raise ValueError(f"must be a number in [0, 1], got {text!r}")
    return value


def _model_shape(text: str) -> ModelShape:
    """A preset name, or the path of a Hugging Face ``config.json`` (or its folder).

    A file that is not one is "PATH is not a JSON model config: REASON" (the JSON error, or the missing key);
    a name that is neither is "'TEXT' is neither a model preset (NAMES) nor a file".
    """
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        try:
            return ModelShape.preset(text)
        except ValueError:
            where = "" if path == Path(text) else f" (a folder without {path.name})"
            raise ValueError(f"{text!r} is neither a model preset ({', '.join(ModelShape.preset_names())}) nor a file"
                             f"{where}") from None
    try:
        config = json.loads(path.read_text())
        if not isinstance(config, dict):
            raise TypeError(f"a JSON {type(config).__name__}, not an object")
        return ModelShape.from_hf_config(config)
    except (ValueError, TypeError, ArithmeticError) as exc:  # bad JSON or UTF-8, a missing key, a bad number
        raise ValueError(f"{path} is not a JSON model config: {exc}") from exc


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add every ``duetserve simulate`` option to ``p``."""
    t = p.add_argument_group("trace")
    t.add_argument("--trace", type=argtypes.existing_file, metavar="FILE",
                   help="Azure .csv or Mooncake .jsonl trace; omit with --format synthetic")
    t.add_argument("--format", default="auto", choices=["auto", "azure", "mooncake", "synthetic"],
                   help="trace format (auto: by suffix; synthetic without --trace)")
    t.add_argument("--qps", required=True, type=argtypes.rates, metavar="Q[,Q2,...]",
                   help="request rates to sweep, req/s")
    t.add_argument("--arrival", default="poisson", choices=["poisson", "scale"],
                   help="poisson: re-draw arrivals at each QPS (gaps of CV --cv); scale: stretch the trace's own")
    t.add_argument("--cv", type=argtypes.finite_non_negative,
                   help="CV of the gamma gaps of --arrival poisson, or of a synthetic trace (default 1 = Poisson)")
    t.add_argument("--window", type=argtypes.window, metavar="START:END",
                   help="keep requests arriving in [START, END) of the trace, e.g. 0:10min")
    t.add_argument("--num-requests", type=argtypes.positive_int, metavar="N",
                   help="first N requests (synthetic: how many)")
    t.add_argument("--max-input-len", type=argtypes.positive_int, metavar="TOKENS")
    t.add_argument("--max-output-len", type=argtypes.positive_int, metavar="TOKENS")
    argtypes.add_length_options(t)
    t.add_argument("--seed", type=argtypes.non_negative_int, default=0, help="seed for lengths and arrivals")

    m = p.add_argument_group("model and GPU")
    m.add_argument("--model-config", type=argtypes.argtype(_model_shape), default="qwen3-8b",
                   metavar="PRESET|PATH", help="model shape: a preset (qwen3-8b, qwen3-14b, llama3-8b, "
                                               "smollm2-135m) or a config.json (default qwen3-8b)")
    m.add_argument("--gpu", "--profile", type=argtypes.argtype(load_profile), default="h200",
                   metavar="NAME|PATH",
                   help=f"hardware profile: {', '.join(available_profiles())} or a JSON file (default h200)")
    m.add_argument("--tp", type=argtypes.positive_int, default=1, help="tensor-parallel GPUs")
    m.add_argument("--partition-backend", choices=PARTITION_BACKENDS, default="greenctx",
                   help="SM partitioning: greenctx (8-SM steps on Hopper), tpcmask (2-SM steps), none")
    m.add_argument("--gpu-memory-utilization", type=argtypes.argtype(_fraction), default=0.9,
                   help="share of HBM for weights and KV cache (default 0.9)")
    m.add_argument("--kv-cache-tokens", type=argtypes.positive_int, metavar="TOKENS",
                   help="KV capacity (default: from the profile's HBM minus the weights)")
    m.add_argument("--clock-profile", type=argtypes.argtype(load_profile), metavar="NAME|PATH",
                   help="hardware profile the simulated iterations take their time from, while the policies "
                        "plan with --gpu's: replays a profile that is wrong about the GPU (default: --gpu)")
    m.add_argument("--prediction-error", type=argtypes.argtype(_sigma), default=0.0, metavar="SIGMA",
                   help="run each iteration for its predicted time times a lognormal factor exp(N(0, SIGMA^2)), "
                        "seeded by --seed (default 0: exactly the prediction; 0.05 is close to the H200's spread)")

    s = p.add_argument_group("scheduling")
    s.add_argument("--policy", type=argtypes.argtype(_policies), default="all", metavar="POLICY[,POLICY...]",
                   help=f"policies to simulate, comma-separated, from {', '.join(POLICIES)}; or all")
    s.add_argument("--tbt-slo", type=argtypes.tbt_slo, default=0.1, metavar="DURATION",
                   help="TBT SLO, e.g. 100ms (bare numbers: ms)")
    s.add_argument("--trim-margin", type=argtypes.trim_margin, default="auto", metavar="FRACTION|auto|off",
                   help="duet: prefer a temporal batch trimmed to FRACTION x the SLO when its predicted token "
                        "rate beats the split (as `serve --trim-margin`; auto, the default: follow the measured "
                        "error, none unless --prediction-error; off: the paper's rule)")
    s.add_argument("--num-decode-steps", type=argtypes.decode_steps, default=8, metavar="N",
                   help="decode-only iterations run up to N steps back to back, stopping when a request arrives "
                        "or one that ended makes room for a waiting one (serve's flag and default, 8; 1 = off)")
    s.add_argument("--piecewise-cuda-graph-max-tokens", type=argtypes.non_negative_int, default=1024, metavar="N",
                   help="temporal iterations with prefill whose batch (decode tokens included) has at most N "
                        "tokens, capped at --max-num-batched-tokens, replay piecewise CUDA graphs, launching fewer "
                        "kernels from the host (serve's flag and default, 1024; 0 = off)")
    s.add_argument("--enforce-eager", action="store_true",
                   help="price every iteration as eager: no CUDA graphs, decode or piecewise "
                        "(as `serve --enforce-eager`)")
    s.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=CUDA_TOKEN_BUDGET,
                   help=f"token budget per iteration (default {CUDA_TOKEN_BUDGET}, serve's on CUDA; 2048 suits A100)")
    s.add_argument("--max-num-seqs", type=argtypes.positive_int, default=EngineConfig.max_num_seqs,
                   help=f"most running sequences (default {EngineConfig.max_num_seqs}, as serve's)")
    s.add_argument("--block-size", type=argtypes.block_size, default=16,
                   help=f"tokens per KV-cache block: {', '.join(map(str, BLOCK_SIZES))} (default 16)")
    s.add_argument("--max-model-len", type=argtypes.positive_int, metavar="TOKENS",
                   help="context limit (default: the model's max_position_embeddings, as serve's; "
                        "the trace's longest request for a config without it)")

    r = p.add_argument_group("results")
    r.add_argument("--json", type=argtypes.output_file, metavar="OUT.json", help="save the rows as a JSON list")
    r.add_argument("--plot", type=argtypes.plot_file, metavar="OUT.png",
                   help="plot TBT, TTFT and throughput against QPS")
    r.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _trace_spec(args: argparse.Namespace, qps: float) -> TraceSpec:
    return TraceSpec(format=args.format, arrival=args.arrival, qps=qps, cv=args.cv, window_s=args.window,
                     num_requests=args.num_requests, max_input_len=args.max_input_len,
                     max_output_len=args.max_output_len, input_len=args.input_len, output_len=args.output_len,
                     seed=args.seed)


def _check_trace_flags(args: argparse.Namespace) -> None:
    """Raise UsageError naming the flag when ``--trace``, ``--format`` and ``--num-requests`` give no trace,
    or ``--cv`` goes with ``--arrival scale`` on a trace file; set ``args.cv`` to its value (``arrival_cv``)."""
    fmt = trace_format(args.trace, args.format, "--format")
    if fmt == "synthetic" and args.num_requests is None:
        raise UsageError("--num-requests is required for a synthetic trace")
    args.cv = argtypes.arrival_cv(args.cv, fmt, args.arrival)


def _check_max_model_len(args: argparse.Namespace) -> None:
    """Raise UsageError naming ``--max-model-len`` when it exceeds the model's context, as serve refuses it."""
    limit = args.model_config.max_positions
    if args.max_model_len is not None and limit is not None and args.max_model_len > limit:
        raise UsageError(f"--max-model-len {args.max_model_len} exceeds the model's limit of {limit} "
                         "positions (--model-config)")


def _check_tp(args: argparse.Namespace) -> None:
    """Raise UsageError naming ``--tp`` when the model's heads or intermediate size do not split that many ways."""
    if (why := args.model_config.tp_split_error(args.tp)) is not None:
        raise UsageError(f"--tp {args.tp}: the model's {why}")


def _check_kv_cache(args: argparse.Namespace, config: SimConfig) -> None:
    """Raise UsageError naming ``--gpu-memory-utilization``, ``--gpu`` and ``--model-config`` when the
    model's weights leave no memory for the KV cache (``simulator.kv_cache_tokens``)."""
    try:
        config.kv_blocks()
    except ValueError as exc:
        raise UsageError(f"--gpu-memory-utilization {args.gpu_memory_utilization:g} of the {args.gpu.name}'s "
                         "memory (--gpu) leaves nothing for the KV cache after the model's weights "
                         "(--model-config); raise it, or give --kv-cache-tokens") from exc


def _check_trace_fits(args: argparse.Namespace, config: SimConfig, trace: Sequence[TraceRequest]) -> None:
    """Raise UsageError, naming the flag, when the KV cache or the context limit leaves no
    request of ``trace`` able to run."""
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < args.block_size:
        raise UsageError(f"--kv-cache-tokens {args.kv_cache_tokens} is less than one KV block of "
                         f"{args.block_size} tokens (--block-size)")
    shortest = min(r.input_len + r.output_len for r in trace)
    of_trace = "of the trace" if args.trace else "of the synthetic trace (--input-len, --output-len)"
    limit = args.max_model_len or args.model_config.max_positions
    if limit is not None and shortest > limit:  # the simulator fails each such request, as serve refuses it
        given = f"--max-model-len {limit}" if args.max_model_len else \
            f"the model's context of {limit} tokens (--model-config; --max-model-len sets another)"
        raise UsageError(f"{given} holds no request {of_trace}: the shortest needs {shortest} tokens of prompt "
                         "and output")
    blocks = config.kv_blocks()
    if -(-shortest // args.block_size) > blocks:
        source = "--kv-cache-tokens" if args.kv_cache_tokens else "--gpu and --gpu-memory-utilization"
        raise UsageError(f"the KV cache of {blocks * args.block_size} tokens (from {source}) holds no request "
                         f"{of_trace}: the shortest needs {shortest} tokens of prompt and output")


def _policies(text: str) -> str:
    """``all`` or a comma-separated list of known policies, each once (returned as given, spaces dropped).

    Errors, as ``--qps``'s: "empty item in 'TEXT'", "unknown policy 'X': use ...", "policy 'X' given twice in 'TEXT'",
    "'all' cannot be listed with other policies".
    """
    if text.strip() == "all":
        return "all"
    names = argtypes.comma_items(text)
    if "all" in names:
        raise ValueError("'all' cannot be listed with other policies: give all alone, or a list of policies")
    if bad := [n for n in names if n not in POLICIES]:
        raise ValueError(f"unknown policy {', '.join(map(repr, bad))}: use {', '.join(POLICIES)} or all")
    if repeated := next((n for i, n in enumerate(names) if n in names[:i]), None):
        raise ValueError(f"policy {repeated!r} given twice in {text!r}")
    return ",".join(names)


def _simulate(args: argparse.Namespace) -> int:
    _check_trace_flags(args)
    _check_tp(args)
    _check_max_model_len(args)
    names = args.policy.split(",") if args.policy != "all" else list(POLICIES)
    if args.policy == "all" and args.partition_backend == "none":
        names.remove("pdmux")
        print("duetserve simulate: pdmux left out: --partition-backend none", file=sys.stderr)
    planner = PlannerConfig(args.model_config, args.gpu, args.tbt_slo, args.partition_backend, tp=args.tp,
                            trim_margin=args.trim_margin,
                            cuda_graphs=not args.enforce_eager,
                            piecewise_tokens=min(args.piecewise_cuda_graph_max_tokens, args.max_num_batched_tokens))
    try:
        for name in names:
            policy_by_name(name, planner)
    except ValueError as exc:  # "--policy pdmux needs an SM partition backend ..."
        raise UsageError(str(exc)) from exc
    try:
        config = SimConfig(planner, args.max_num_seqs, args.max_num_batched_tokens, args.block_size,
                           args.kv_cache_tokens, args.gpu_memory_utilization, args.max_model_len,
                           args.prediction_error, args.seed, args.clock_profile, args.num_decode_steps)
    except ValueError as exc:  # only the clock profile can be wrong here: the other fields were checked
        raise UsageError(f"--clock-profile: {exc} (--gpu)") from exc
    _check_kv_cache(args, config)
    rows = []
    for qps in args.qps:
        trace = argtypes.read_trace(args.trace, _trace_spec(args, qps))
        _check_trace_fits(args, config, trace)
        for name in names:  # a fresh policy each run, as a fresh server: duet's learned state starts over
            result = simulate(trace, policy_by_name(name, planner), config, not args.no_progress, f"{name} qps {qps:g}")
            rows.append(summarize(result, qps, args.tbt_slo))
    rows.sort(key=lambda r: (names.index(r["policy"]), r["qps"]))
    print(format_table(rows))
    print()
    print(format_capacity(rows))
    if args.json:
        argtypes.write_output(args.json, dumps(rows, indent=1), "--json")  # an infinite --qps is "inf"
        print(f"json: {args.json}")
    if args.plot:
        plot_rows(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``duetserve simulate`` with parsed arguments; 0 on success, 2 on a usage error (a bad
    --trace file included), 1 on any other error (the message goes to stderr)."""
    try:
        return _simulate(args)
    except (ValueError, OSError) as exc:
        return argtypes.exit_status("simulate", exc)
