"""Engine configuration and small parsers shared by the CLI and the server."""
from __future__ import annotations

import re
from dataclasses import dataclass

from duetserve.partition.base import BACKENDS as PARTITION_BACKENDS

POLICIES = ("chunked", "prefill-first", "duet", "pdmux")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
"""Tokens per KV-cache block (``--block-size``): vLLM's choices. The Triton kernels compile once per
block size (a constexpr), flash-attn needs 256, and a larger block wastes the KV cache on short requests."""
CUDA_TOKEN_BUDGET = 8192
"""``serve``'s ``--max-num-batched-tokens`` on CUDA (512 on a CPU), and ``simulate``'s default."""

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|min)?\s*$")
_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}


def parse_duration(text: str | float, bare_unit: str = "s") -> float:
    """Seconds in a duration such as ``"100ms"``, ``"0.1s"``, ``"250us"`` or ``"2min"``.

    A bare number is in ``bare_unit`` (``us``, ``ms``, ``s`` or ``min``).

    Raises:
        ValueError: not a non-negative number with an optional known unit.
    """
    if isinstance(text, (int, float)):
        text = str(text)
    match = _DURATION.match(text)
    if not match:
        negative = text.strip().startswith("-") and _DURATION.match(text.strip()[1:])
        raise ValueError(f"bad duration {text!r}: " + ("a duration cannot be negative" if negative else
                                                       "expected e.g. 100ms, 0.1s, 2min"))
    return float(match.group(1)) * _UNITS_S[match.group(2) or bare_unit]


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    Attributes:
        model: Hugging Face folder, ``.gguf`` file, or None for the embedded SmolLM2-135M-Instruct.
        load_format: ``auto`` (real weights) or ``dummy`` (random weights with the config's shapes).
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``float16`` or ``bfloat16``.
        max_num_seqs: most sequences running at once (vLLM's default, 256; on the H200 serving
            Azure conv at QPS 20 it served 1.22x the requests of 64 with a 24x lower mean TTFT,
            docs/benchmarks.md, twenty-eighth session).
        max_num_batched_tokens: token budget of one iteration (prefill chunks + decode tokens).
        block_size: tokens per KV-cache block.
        num_kv_blocks: KV-cache blocks; None sizes the cache from ``kv_cache_memory_fraction``.
        kv_cache_memory_fraction: share of free device memory (CUDA) or of ``cpu_kv_cache_bytes``
            (CPU) given to the KV cache when ``num_kv_blocks`` is None.
        cpu_kv_cache_bytes: KV-cache memory pool on the CPU, bytes.
        max_model_len: longest sequence (prompt + output) in tokens; None takes the model's limit.
        policy: scheduling policy, one of ``POLICIES``.
        tbt_slo_s: time-between-tokens SLO in seconds.
        hardware_profile: GPU profile (shipped name or JSON path) of the cost model that
            ``duet`` and ``pdmux`` plan with; on CPU its predictions describe that GPU.
        partition_backend: SM partitioning the planner may use, one of ``PARTITION_BACKENDS``;
            ``none`` (the engine runs no spatial plans yet) keeps plans temporal and refuses
            ``pdmux``; ``auto`` falls back to ``none``, while an explicit backend that cannot
            run makes ``LLMEngine`` raise.
        seed: seed for dummy weights and for unseeded sampling, in [0, 2**64).
        attention_backend: one of ``ATTENTION_BACKENDS`` (see ``duetserve.model.backends``).
        enforce_eager: never replay CUDA graphs (decode and prefill run eagerly).
        piecewise_cuda_graph_max_tokens: on CUDA, temporal iterations with prefill whose batch
            (decode tokens included) has at most this many tokens (capped at
            ``max_num_batched_tokens``; none with ``enforce_eager``) replay piecewise CUDA graphs,
            attention launched eagerly between them (``duetserve.engine.piecewise_graphs``); 0 runs
            them eagerly. SGLang's ``--piecewise-cuda-graph-max-tokens``.
        num_decode_steps: decode-only iterations run up to this many steps back to back (each
            step queued behind the running one, tokens streamed per step; like vLLM's multi-step
            scheduling), stopping early when a request arrives or is aborted, or when one that
            ended makes room for a waiting one (``Scheduler.can_admit``); 1 turns it off.
        trim_margin: duet: also consider a temporal batch with its prefill trimmed to fit this
            share of ``tbt_slo_s`` and run it instead of a split when its predicted token rate
            is higher (``plan_iteration``); ``"auto"``: a share that follows the measured error
            of temporal iterations (``DuetPolicy.trim_margin``), and splits' decode steps planned
            with room for their measured error (``DuetPolicy.decode_spread``; the default);
            None keeps the paper's rule.
        decode_stream: record the CUDA graphs of decode batches of up to 8 sequences with the
            weight-stream kernels (``duetserve.model.decode_stream``; experimental: Qwen3 shapes,
            sm_90, nvcc and cuda-bindings).
    """

    model: str | None = None
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30
    max_model_len: int | None = None
    policy: str = "chunked"
    tbt_slo_s: float = 0.1
    hardware_profile: str = "h200"
    partition_backend: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    piecewise_cuda_graph_max_tokens: int = 1024
    num_decode_steps: int = 8
    trim_margin: float | str | None = "auto"
    decode_stream: bool = False

    @property
    def piecewise_tokens(self) -> int:
        """Largest batch, tokens, the engine replays from piecewise CUDA graphs on CUDA:
        ``piecewise_cuda_graph_max_tokens`` capped at the token budget; 0 with ``enforce_eager``."""
        return 0 if self.enforce_eager else min(self.piecewise_cuda_graph_max_tokens, self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        checks = [
            (self.policy in POLICIES, "--policy", f"must be one of {', '.join(POLICIES)}"),
            (self.attention_backend in ATTENTION_BACKENDS, "--attention-backend",
             f"must be one of {', '.join(ATTENTION_BACKENDS)}"),
            (self.load_format in ("auto", "dummy"), "--load-format", "must be auto or dummy"),
            (self.dtype in ("auto", "float32", "float16", "bfloat16"), "--dtype",
             "must be auto, float32, float16 or bfloat16"),
            (self.max_num_seqs >= 1, "--max-num-seqs", "must be >= 1"),
            (self.max_num_batched_tokens >= 1, "--max-num-batched-tokens", "must be >= 1"),
            (self.piecewise_cuda_graph_max_tokens >= 0, "--piecewise-cuda-graph-max-tokens", "must be >= 0"),
            (1 <= self.num_decode_steps <= 256, "--num-decode-steps", "must be in [1, 256]"),
            (self.trim_margin in (None, "auto") or (not isinstance(self.trim_margin, str) and 0 < self.trim_margin <= 1),
             "--trim-margin", "must be in (0, 1], auto or None (off)"),
            (self.block_size in BLOCK_SIZES, "--block-size", f"must be one of {', '.join(map(str, BLOCK_SIZES))}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "--num-kv-blocks", "must be >= 1"),
            (0 < self.kv_cache_memory_fraction <= 1, "--kv-cache-memory-fraction", "must be in (0, 1]"),
            (self.cpu_kv_cache_bytes > 0, "--cpu-kv-cache-gb", "must be positive"),
            (self.max_model_len is None or self.max_model_len >= 2, "--max-model-len", "must be >= 2"),
            (self.tbt_slo_s > 0, "--tbt-slo", "must be positive"),
            (0 <= self.seed < 2**64, "--seed", "must be in [0, 2**64)"),  # torch's generators take no more
            (self.partition_backend in PARTITION_BACKENDS + ("auto",), "--partition-backend",
             f"must be auto or one of {', '.join(PARTITION_BACKENDS)}"),
            (not self.decode_stream or (self.device.startswith("cuda") and not self.enforce_eager), "--decode-stream",
             "needs decode CUDA graphs: a CUDA device and no --enforce-eager"),
            (self.policy != "pdmux" or self.partition_backend != "none", "--policy",
             "pdmux needs an SM partition backend (greenctx or tpcmask); this engine has none: "
             "use duet, chunked or prefill-first"),
        ]
        for ok, flag, message in checks:
            if not ok:
                raise ValueError(f"{flag} {message}")
