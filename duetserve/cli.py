"""``duetserve`` command line: ``serve``, and the offline tools ``bench``, ``calibrate``, ``simulate``."""
from __future__ import annotations

import argparse
import errno
import gc
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path

from duetserve import __version__
from duetserve.argtypes import (
    block_size,
    decode_steps,
    exit_on_interrupt,
    join_negative_values,
    non_empty,
    non_negative_int,
    positive_duration,
    tbt_slo,
    trim_margin,
)
from duetserve.bench import cli as bench_cli
from duetserve.calibrate import cli as calibrate_cli
from duetserve.config import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    CUDA_TOKEN_BUDGET,
    POLICIES,
    EngineConfig,
)
from duetserve.partition.base import BACKENDS as PARTITION_BACKENDS
from duetserve.sim import cli as sim_cli

# Seconds between ending the requests still running at --shutdown-timeout and uvicorn closing
# their connections: time for their last chunks and [DONE] to be written.
ABORT_GRACE_S = 5.0
# The offline tools: subcommand, module (``configure_parser`` and ``run``), one-line help.
TOOLS = (("bench", bench_cli, "replay a trace against an OpenAI-compatible server"),
         ("calibrate", calibrate_cli, "measure this GPU into a hardware profile"),
         ("simulate", sim_cli, "replay a trace on the cost model (no GPU)"))


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..65535, got {text!r}")
    return port


def _positive_float(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
        return value
    parse.__name__ = flag
    return parse


class _DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where the help does not already say the default and X is not None."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                       formatter_class=_DefaultsOnceFormatter)
    p.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", type=non_empty, default=None,
                   help="model name in the API (default: from --model)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights with the config's shapes")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on")
    p.add_argument("--tbt-slo", type=tbt_slo, default="100ms",
                   help="TBT SLO, e.g. 100ms or 0.1s (a bare number is milliseconds, as in simulate and bench)")
    p.add_argument("--policy", choices=POLICIES, default="duet",
                   help="scheduling policy (pdmux needs an SM partition backend: a CUDA GPU)")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs, help="most sequences per iteration")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"token budget per iteration (default: 512 on CPU, {CUDA_TOKEN_BUDGET} on CUDA)")
    p.add_argument("--block-size", type=block_size, default=16,
                   help=f"tokens per KV-cache block: {', '.join(map(str, BLOCK_SIZES))}")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks")
    group.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                       help="share of free GPU memory (or of --cpu-kv-cache-gb on CPU) for the KV cache")
    p.add_argument("--cpu-kv-cache-gb", type=_positive_float("--cpu-kv-cache-gb"), default=2.0,
                   help="KV-cache pool on the CPU, GiB")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit, tokens (default: the model's)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help="auto: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto: flash-attn if it imports and fits, else triton on CUDA; torch on the CPU")
    p.add_argument("--profile", default="h200", metavar="NAME|PATH", help="GPU profile the planner predicts with: "
                   "a shipped name or a JSON file from duetserve calibrate")
    p.add_argument("--partition-backend", choices=("auto", *PARTITION_BACKENDS), default="auto",
                   help="SM partitioning for spatial plans: auto = green contexts on CUDA (self-tested at "
                        "start, falls back to none), none on the CPU; greenctx or tpcmask that cannot run "
                        "here, or fails its self-test, is an error")
    p.add_argument("--libsmctrl", default=None, metavar="PATH",
                   help="use this libsmctrl.so for --partition-backend tpcmask instead of the built-in shim")
    p.add_argument("--iteration-log", default=None, metavar="PATH",
                   help="append one JSON line per engine iteration (plan, SMs, k, predicted and measured seconds)")
    p.add_argument("--api-key", type=non_empty, default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (an empty KEY is refused: it would "
                        "turn authentication off)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed for dummy weights and unseeded sampling")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode and prefill run eagerly)")
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=non_negative_int, default=1024, metavar="N",
                   help="on CUDA, temporal iterations with prefill whose batch (decode tokens included) has at "
                        "most N tokens, capped at --max-num-batched-tokens, replay piecewise CUDA graphs "
                        "(attention eager between them; cuts the host's launch time); --enforce-eager or 0 = off "
                        "(default 1024)")
    p.add_argument("--num-decode-steps", type=decode_steps, default=8, metavar="N",
                   help="decode-only iterations run up to N steps back to back, stopping when a request "
                        "arrives or one that ended makes room for a waiting one (hides the host time between "
                        "steps; default 8; 1 = off)")
    p.add_argument("--trim-margin", type=trim_margin, default="auto", metavar="FRACTION|auto|off",
                   help="duet: when a split is planned, run a temporal batch with its prefill trimmed to fit "
                        "FRACTION x --tbt-slo instead if its predicted token rate is higher (e.g. 0.85); auto "
                        "(default): a margin that follows the measured error of temporal iterations, and decode "
                        "steps of splits planned with room for their measured error's p99; off: the paper's rule")
    p.add_argument("--decode-stream", action="store_true",
                   help="experimental, within 1.5%% of the default decode graphs' speed: decode batches of up to 8 "
                        "through the weight-stream kernels (Qwen3 shapes, sm_90 GPU, nvcc and cuda-bindings)")
    p.add_argument("--engine-process", action="store_true",
                   help="run the engine loop in a process of its own, apart from the HTTP server's event loop "
                        "(vLLM's and SGLang's layout; the engine's Python then shares no GIL with the server); "
                        "if that process dies, the server fails its requests and exits with status 1")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level")
    p.add_argument("--shutdown-timeout", type=positive_duration("s"), default="30s", metavar="DURATION",
                   help="on SIGINT or SIGTERM, wait at most this long for running requests (e.g. 30s, 500ms; "
                        "a bare number is seconds), then end them with finish_reason abort (streams end with "
                        "[DONE]) and stop the engine")


def _serve(args, parser: argparse.ArgumentParser) -> int:
    import torch

    from duetserve.model.fused_ops import fused_mode
    from duetserve.model.layers import decode_gemm_mode

    try:  # read later otherwise: at graph capture, or by every request (DUETSERVE_FUSED)
        decode_gemm_mode()
        fused_mode()
    except ValueError as exc:
        parser.error(str(exc))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        parser.error(f"--device {device}: use cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available on this machine")
    config = _engine_config(args, parser, device)
    with _bind(args.host, args.port, parser) as sock:  # fail now, not after loading the model for seconds
        return _serve_on(sock, args, parser, config)


def _engine_config(args: argparse.Namespace, parser: argparse.ArgumentParser, device: str) -> EngineConfig:
    """The engine's configuration from the flags, each checked (``parser.error`` naming the flag)
    before the port is bound and the model loaded."""
    from duetserve.planner.hardware import load_profile

    if args.policy == "pdmux" and device == "cpu":
        parser.error("--policy pdmux needs an SM partition backend (a CUDA GPU); use duet, chunked or prefill-first")
    try:
        load_profile(args.profile)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(f"--profile {args.profile}: {exc}")
    if args.iteration_log:  # fail now, not after loading the model
        try:
            open(args.iteration_log, "a").close()
        except OSError as exc:
            parser.error(f"--iteration-log {args.iteration_log}: {exc.strerror}")
    if args.libsmctrl:
        if not Path(args.libsmctrl).is_file():
            parser.error(f"--libsmctrl {args.libsmctrl}: no such file")
        os.environ["DUETSERVE_LIBSMCTRL"] = args.libsmctrl
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = CUDA_TOKEN_BUDGET if device.startswith("cuda") else 512
    try:
        return EngineConfig(model=args.model, load_format=args.load_format, device=device, dtype=args.dtype,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                            cpu_kv_cache_bytes=int(args.cpu_kv_cache_gb * (1 << 30)),
                            max_model_len=args.max_model_len, policy=args.policy, tbt_slo_s=args.tbt_slo,
                            hardware_profile=args.profile, partition_backend=args.partition_backend,
                            seed=args.seed, enforce_eager=args.enforce_eager,
                            piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
                            num_decode_steps=args.num_decode_steps, trim_margin=args.trim_margin,
                            decode_stream=args.decode_stream,
                            attention_backend=args.attention_backend)
    except ValueError as exc:
        parser.error(str(exc))


def _bind(host: str, port: int, parser: argparse.ArgumentParser) -> socket.socket:
    """A socket bound to ``host``:``port`` (0: a free port) for uvicorn to listen on, so the port that
    ``serve`` logs is the one it serves on; a host or port it cannot bind is ``parser.error`` naming
    ``--host`` or ``--port``."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if isinstance(exc, socket.gaierror):  # the host is no address
            parser.error(f"--host {host}: {exc.strerror or exc}")
        if exc.errno == errno.EADDRNOTAVAIL:
            parser.error(f"--host {host}: not an address of this machine ({exc.strerror})")
        parser.error(f"--port {port}: cannot listen on {host}: {exc.strerror or exc}")
    return sock


def _serve_on(sock: socket.socket, args: argparse.Namespace, parser: argparse.ArgumentParser,
              config: EngineConfig) -> int:
    """Load the model and serve it on ``sock`` (bound by ``_bind``) until stopped; 0 when it stops."""
    import uvicorn

    from duetserve.engine.async_engine import AsyncEngine, EngineFront
    from duetserve.engine.engine import LLMEngine
    from duetserve.engine.engine_process import EngineProcess
    from duetserve.server.api import create_app
    from duetserve.server.metrics import ServerMetrics
    from duetserve.server.shutdown import DrainingServer

    try:
        async_engine: EngineFront = EngineProcess(config) if args.engine_process else AsyncEngine(LLMEngine(config))
    except (ValueError, FileNotFoundError, KeyError) as exc:
        parser.error(str(exc))
    name = args.served_model_name or async_engine.model_name
    try:
        metrics = ServerMetrics(name, args.iteration_log)
    except OSError as exc:
        parser.error(f"--iteration-log {args.iteration_log}: {exc.strerror}")
    metrics.watch_engine(async_engine)
    async_engine.observer = metrics

    stopped = False

    def stop() -> None:  # once: at the app's shutdown, or in the finally below
        nonlocal stopped
        if stopped:
            return
        stopped = True
        log = logging.getLogger(__name__)
        if async_engine.shutdown(timeout_s=10.0):
            log.info("engine stopped")
        else:
            log.warning("the engine loop is still in a step 10 s after the stop; exiting without it")
        if not args.engine_process:  # else the allocator is the engine process's
            _log_allocator(config.device)

    app = create_app(async_engine, metrics, name, api_key=args.api_key, on_shutdown=stop)
    server = DrainingServer(uvicorn.Config(app, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S),
                            async_engine.abort_all, args.shutdown_timeout)
    engine_died = threading.Event()
    if args.engine_process:
        def on_engine_death() -> None:  # on the engine's reader thread; the streams have failed
            logging.getLogger(__name__).error("shutting the server down: its engine is gone")
            engine_died.set()
            server.should_exit = True  # uvicorn's main loop looks every 0.1 s

        async_engine.on_death = on_engine_death
    async_engine.start()
    logging.getLogger(__name__).info("serving %s on http://%s:%d (policy %s, TBT SLO %.0f ms)", name, args.host,
                                     sock.getsockname()[1], args.policy, args.tbt_slo * 1e3)
    # Everything alive now (model, tokenizer, libraries: about 310k objects with the default
    # model) leaves the collector's view, as vLLM does after start-up: a full collection, which
    # holds the GIL and so the engine thread, then scans only what serving allocates. On this
    # project's 2-core CPU machine one took 140-176 ms before and 2.8 ms after. On the H200 host a
    # split's iteration once stalled 104 ms beyond its streams, about that long (not shown to be
    # a collection; docs/benchmarks.md, fifteenth session).
    gc.collect()
    gc.freeze()

    try:
        server.run(sockets=[sock])
    finally:  # not reached on SIGTERM (see create_app): the app's shutdown runs stop()
        gc.unfreeze()
        stop()  # returned without the app's shutdown (a failed start-up): nothing ran it
    if server.exit_signal == signal.SIGINT:
        # uvicorn raises the signal again once it has stopped, which ends here as KeyboardInterrupt;
        # a process started with SIGINT ignored (`&` in a script) returns instead: end the same way
        raise KeyboardInterrupt
    return 1 if engine_died.is_set() else 0


def _log_allocator(device: str) -> None:
    """Log the CUDA caching allocator's counts since start-up: a retry frees cached blocks
    (``cudaFree`` synchronizes the device) and so can stall the host launching an iteration."""
    import torch

    if device.startswith("cuda"):
        stats = torch.cuda.memory_stats(device)
        logging.getLogger(__name__).info(
            "CUDA allocator: %d retries, %d OOMs, %d cudaMalloc and %d cudaFree calls, peak %.1f GiB",
            stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0), stats.get("num_device_alloc", 0),
            stats.get("num_device_free", 0), stats.get("allocated_bytes.all.peak", 0) / 2**30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="duetserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    for name, module, summary in TOOLS:
        tool = sub.add_parser(name, help=summary, description=module.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        module.configure_parser(tool)
        tool.set_defaults(func=module.run)
    # Required options are checked after the unknown ones: argparse checks them first, so `simulate
    # --bogus` said "--qps is required" instead of naming the flag it does not know.
    required = [a for command in sub.choices.values() for a in command._actions if a.required and a.option_strings]
    for action in required:
        action.required = False
    typed = list(sys.argv[1:] if argv is None else argv)
    joined = join_negative_values(typed)
    try:
        args, unknown = parser.parse_known_args(joined)
    finally:
        for action in required:
            action.required = True
    command = sub.choices[args.command]
    if unknown:  # as the subcommand's own parser words it (its usage line and prog), not the top level's
        as_typed = {item: item.replace("=", " ", 1) for item in set(joined) - set(typed)}  # --flag -5 was joined
        command.error(f"unrecognized arguments: {' '.join(as_typed.get(item, item) for item in unknown)}")
    missing = [a.option_strings[0] for a in required if a in command._actions and getattr(args, a.dest) is None]
    if missing:
        command.error(f"the following arguments are required: {', '.join(missing)}")
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return exit_on_interrupt("serve", lambda: _serve(args, sub.choices["serve"]))
    return exit_on_interrupt(args.command, lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
