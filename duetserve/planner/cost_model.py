"""Attention-aware roofline cost model (docs/design.md section 3; DuetServe paper section 4.1).

Every operator costs ``t = max(F / Pi(S), B / BW(S))`` seconds, with F its FLOPs, B the
bytes it moves and Pi, BW the rates of S SMs from a ``HardwareProfile``. A transformer
block is the sum of its operators; the model is ``layers * t_block + t_lm_head``.

Operators per block (one decoder layer of the Llama / Qwen3 family, per GPU under TP):

* linear (token-level): qkv, o, gate+up, down, with ``F = 2 n d_i d_o`` and
  ``B = b (n d_i + d_i d_o + n d_o)`` for ``n`` batch tokens and ``b`` bytes per element;
* norm_act (token-level): two RMSNorms (``F = 4 n d``, ``B = b (2 n d + d)``) and the
  SiLU-and-multiply (``F = 5 n i``, ``B = 3 b n i``). Residual adds, RoPE and Qwen3's q/k
  norms are taken as fused into neighbouring kernels and not counted. Token-level operators
  (these, and lm_head) take their FLOPs at ``Pi(S)`` times the profile's ``gemm_efficiency``
  (beyond the paper: the share of the measured square-GEMM rate the served model's own GEMMs
  reach, fitted by ``duetserve calibrate``);
* attention (sequence-level), per request with ``q`` new and ``c`` cached tokens:
  ``F = (4 d_h + 2) h_q P`` and ``B = b (2 h_q q d_h + 2 h_kv (q + c) d_h)`` where ``P`` is
  the number of (query, key) pairs computed; the batch's time is the sum of each request's
  roofline time, its FLOPs at ``Pi(S)`` times the profile's ``attention_efficiency`` (beyond
  the paper: the attention kernel's measured share of the GEMM rate);
* communication under TP over N GPUs: two all-reduces of the ``n x hidden`` output per
  block, ``2(N-1) alpha + 2(N-1) B_o / (N BW_link) + N(N-1) B_o / Pi(S)``, the third term
  read as one operation per byte, as the paper writes it.

Causal attention FLOPs (``causal=True``, the default): ``P = q c + q (q + 1) / 2``, the
pairs a causal mask leaves, instead of the paper's ``P = q (q + c)``. Flash-attention
kernels skip tiles above the diagonal, so executed work tracks the causal count: on the
H200 (torch 2.11 SDPA flash backend, 32 heads of 128, bf16) non-causal / causal time was
1.23, 1.55, 1.77, 1.92 at 2k, 4k, 8k, 16k tokens, approaching 2 as diagonal tiles become a
small share. Bytes do not change: K and V are read once either way.

lm_head: a token-level linear ``hidden -> vocab``. With ``lm_head="last"`` (default) it
runs over one token per request, the logits sampling needs; pass ``lm_head_tokens`` when the
caller knows better (a prefill chunk that does not finish its prompt needs none). With
``lm_head="all"`` it runs over every query token, as the "PD multiplexing" notebook's estimate does.

Per-kernel overheads (beyond the paper; docs/design.md section 3, "go beyond the paper where
measurement says so"). On the H200 the roofline under-predicted every CUDA-graph decode step
by about 6 ms and eager iterations by far more (docs/benchmarks.md, 2026-11-30): the engine
launches ~60 small kernels per layer, each costing a few microseconds of GPU time even inside
a graph, and ~15 us of host time when launched eagerly. With ``n`` kernels in the iteration
(``HardwareProfile.iteration_kernels``), ``g = kernel_gpu_s`` and ``h = launch_cpu_s``:

* replayed from CUDA graphs: ``t = roofline + n g``;
* eager: ``t = max(roofline + n g, n h)``; the GPU runs while the host launches, so the
  slower of the two wins.

The engine replays decode-only batches from graphs (buckets up to ``max_num_seqs``, also on
split SM levels); iterations with prefill tokens run eagerly. So by default (``graphs=None``)
an iteration whose requests all have ``q <= 1`` counts as graph-replayed with the profile's
``"decode"`` kernel count (the ``"narrow_decode"`` count when it has at most the profile's
``narrow_decode_batch`` requests: those graphs record fewer kernels, see
``HardwareProfile.iteration_kernels``), any other as eager with the ``"prefill"`` count; ``cuda_graphs=False``
(an engine with ``enforce_eager``) makes every iteration eager. With ``piecewise_tokens`` > 0, an
iteration with prefill tokens of at most that many tokens (``graphs`` None, ``cuda_graphs`` on) is replayed from
piecewise CUDA graphs (``duetserve.engine.piecewise_graphs``): its GPU runs the ``"prefill"``
count, its host launches only the profile's ``"piecewise"`` count (``hardware.PIECEWISE``; a
profile without one prices it eager), ``t = max(roofline + n g, n_pw h)``, and its host time
(below) takes ``host_piecewise_s`` in place of ``host_eager_s``. ``predict`` /
``predict_total`` take ``graphs`` to say it per call. The counts are measured at the
calibrated TP degree; all-reduce kernels added by other degrees are not counted. With the
default profile (both constants 0) ``t`` is exactly the roofline. The overheads are the
``Breakdown.overhead`` field, and ``predict_spatial``'s interference factors scale them with
the rest (conservative on both sides).

Host time (beyond the paper, measured on the serving engine): an iteration of ``R`` requests
also costs ``R h_r + e h_e`` seconds of host work that no GPU work hides (scheduling, inputs,
the token read, detokenizing and streaming), with ``h_r = host_per_request_s``, ``h_e =
host_eager_s`` and ``e = 1`` for an eager iteration (``h_pw = host_piecewise_s`` in place of
``h_e`` for one replayed from piecewise graphs, when the profile has it). On the H200 serving
Azure code through the HTTP server (docs/benchmarks.md, fourth H200 session) temporal iterations took 1.26-1.30x
their prediction without it (median error 22.5%) and 5.3% with the fitted terms. The decode
steps of a spatial plan leave it out: each step's host work runs while the next step is on
the GPU (measured steps were 0.89x their prediction); the first step's, before both streams,
``duetserve.planner.optimizer`` adds to that step's budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from duetserve.planner.hardware import PIECEWISE, HardwareProfile

Request = tuple[int, int]
"""One request in a batch: (q new/query tokens, c cached tokens). q=1 decode, c=0 prefill."""

_PRESET_CONFIGS: dict[str, dict[str, object]] = {
    "qwen3-8b": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False,
                 "max_position_embeddings": 40960},
    "qwen3-14b": {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
                  "head_dim": 128, "intermediate_size": 17408, "vocab_size": 151936, "tie_word_embeddings": False,
                  "max_position_embeddings": 40960},
    "llama3-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
                  "max_position_embeddings": 8192},
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
                     "max_position_embeddings": 8192},
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama/Qwen3-family decoder that the cost model needs.

    ``hidden``, ``head_dim`` and ``intermediate`` are element counts, ``vocab`` tokens;
    ``max_positions`` the context the model takes (``max_position_embeddings``), tokens, None
    when the config does not say.
    """

    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    max_positions: int | None = None

    def tp_split_error(self, tp: int) -> str | None:
        """Why ``tp`` GPUs cannot split this model (as ``CostModel`` splits it), or None when they can.

        Query heads and the intermediate size must divide by ``tp``; KV heads too unless they
        are fewer than ``tp`` (then replicated). E.g. "32 query heads and 8 KV heads are not
        divisible by 3".
        """
        bad = [f"{self.q_heads} query heads"] if self.q_heads % tp else []
        if self.kv_heads >= tp and self.kv_heads % tp:
            bad.append(f"{self.kv_heads} KV heads")
        if self.intermediate % tp:
            bad.append(f"intermediate size {self.intermediate}")
        if not bad:
            return None
        what = bad[0] if len(bad) == 1 else f"{', '.join(bad[:-1])} and {bad[-1]}"
        verb = "is" if what.startswith("intermediate") else "are"  # the size alone is singular
        return f"{what} {verb} not divisible by {tp}"

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object]) -> ModelShape:
        """Build from a Hugging Face ``config.json`` dict.

        ``num_key_value_heads`` defaults to the query heads, ``head_dim`` to
        ``hidden_size // num_attention_heads``, ``tie_word_embeddings`` to False,
        ``max_position_embeddings`` to None.
        Raises ValueError naming the first missing required key, a dimension that is not an
        integer >= 1 (0 layers divided by zero in the simulator; 1.5 was read as 1), or query
        heads that are not a multiple of the KV heads.
        """
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        for key in required:
            if key not in config:
                raise ValueError(f"config has no {key!r}")
        for key in (*required, "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = config.get(key)
            if (key in required or value is not None) and (isinstance(value, bool) or not isinstance(value, int)
                                                            or value < 1):
                raise ValueError(f"config {key!r} must be an integer >= 1, got {value!r}")
        heads = int(config["num_attention_heads"])
        if heads % int(config.get("num_key_value_heads") or heads):
            raise ValueError(f"config 'num_attention_heads' ({heads}) must be a multiple of 'num_key_value_heads' "
                             f"({config['num_key_value_heads']})")
        return cls(
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            q_heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_positions=config.get("max_position_embeddings"),
        )

    @staticmethod
    def preset_names() -> list[str]:
        """Names ``preset`` takes, sorted."""
        return sorted(_PRESET_CONFIGS)

    @classmethod
    def preset(cls, name: str) -> ModelShape:
        """Shapes of known models: ``qwen3-8b``, ``qwen3-14b``, ``llama3-8b``, ``smollm2-135m``
        (values from their published config.json). Raises ValueError for other names."""
        if name.lower() not in _PRESET_CONFIGS:
            raise ValueError(f"unknown model preset {name!r}; known {cls.preset_names()}")
        return cls.from_hf_config(_PRESET_CONFIGS[name.lower()])


@dataclass(frozen=True)
class Breakdown:
    """Predicted seconds of one forward pass, by operator class (all layers summed)."""

    linear: float
    attention: float
    norm_act: float
    communication: float
    lm_head: float
    overhead: float
    """Per-kernel GPU time, or the host launch time by which it exceeds the GPU's (module docstring)."""

    @property
    def total(self) -> float:
        """Predicted iteration time in seconds."""
        return self.linear + self.attention + self.norm_act + self.communication + self.lm_head + self.overhead


def _linear_op(d_in: float, d_out: float, b: int) -> tuple[float, float, float]:
    """(FLOPs per token, bytes per token, fixed bytes) of a linear layer:
    F = 2 n d_i d_o, B = b (n d_i + d_i d_o + n d_o)."""
    return 2 * d_in * d_out, b * (d_in + d_out), b * d_in * d_out


class CostModel:
    """Roofline latency predictor for one model on one GPU type (docs/design.md section 3).

    Args:
        shape: model dimensions.
        profile: hardware curves Pi(S), BW(S) and interconnect figures.
        dtype_bytes: bytes per weight/activation/KV element (2 for bf16).
        tp: tensor-parallel degree N; heads, intermediate and vocab are split N ways
            (KV heads replicated when fewer than N), plus two all-reduces per block.
        causal: count causal attention FLOPs (see module docstring).
        lm_head: ``"last"`` (one token per request by default) or ``"all"`` query tokens.
        decode_margin: >= 1, multiplies the decode side of spatial plans on top of the
            profile's ``decode_interference``; the knob for being more conservative about
            decode on few SMs (docs/design.md section 3; the DuetServe paper's reasoning: underestimating
            decode starves prefill, overestimating only wastes a little decode time).
        cuda_graphs: whether the engine replays decode-only iterations from CUDA graphs
            (False for ``enforce_eager``); decides the default of ``graphs`` (module docstring).
        piecewise_tokens: >= 0, the engine replays iterations with prefill tokens of up to this
            many tokens from piecewise CUDA graphs (module docstring; 0: none).
        prefill_scale: > 0, multiplies the prefill's GPU time in spatial plans on top of the
            profile's ``prefill_interference`` (``DuetPolicy.observe`` sets it from measurements).

    ``decode_level_scale`` (attribute, float array of ``num_sms + 1``, ones at first): a further
    factor on the decode side of spatial plans, indexed by the decode partition's SM count
    (``DuetPolicy.observe`` sets it per level from measurements; index 0 is unused).

    Raises:
        ValueError: on non-positive sizes, heads not divisible by ``tp``, an unknown
            ``lm_head`` mode, ``decode_margin < 1``, ``prefill_scale <= 0`` or ``piecewise_tokens < 0``.

    Rates for every integer S in 1..num_sms are computed once here, so predictions only
    index arrays; ``predict_total`` evaluates many S at once for the optimizer.
    """

    def __init__(self, shape: ModelShape, profile: HardwareProfile, dtype_bytes: int = 2, tp: int = 1,
                 causal: bool = True, lm_head: Literal["last", "all"] = "last",
                 decode_margin: float = 1.0, cuda_graphs: bool = True, prefill_scale: float = 1.0,
                 piecewise_tokens: int = 0) -> None:
        if dtype_bytes <= 0 or tp <= 0:
            raise ValueError("dtype_bytes and tp must be positive")
        if (why := shape.tp_split_error(tp)) is not None:
            raise ValueError(f"tp={tp}: the model's {why}")
        if lm_head not in ("last", "all"):
            raise ValueError(f"lm_head must be 'last' or 'all', got {lm_head!r}")
        if decode_margin < 1.0:
            raise ValueError("decode_margin must be >= 1")
        if prefill_scale <= 0:
            raise ValueError("prefill_scale must be positive")
        if piecewise_tokens < 0:
            raise ValueError("piecewise_tokens must be >= 0")
        self.shape, self.profile, self.tp = shape, profile, tp
        self.dtype_bytes, self.causal, self.lm_head, self.decode_margin = dtype_bytes, causal, lm_head, decode_margin
        self.cuda_graphs, self.prefill_scale, self.piecewise_tokens = cuda_graphs, prefill_scale, piecewise_tokens
        self.decode_level_scale = np.ones(profile.num_sms + 1)

        b, d, dh = dtype_bytes, shape.hidden, shape.head_dim
        self._hq = shape.q_heads // tp
        self._hkv = max(1, shape.kv_heads // tp)
        inter = shape.intermediate // tp
        linear = [_linear_op(d, (self._hq + 2 * self._hkv) * dh, b), _linear_op(self._hq * dh, d, b),
                  _linear_op(d, 2 * inter, b), _linear_op(inter, d, b)]
        norm_act = [(4 * d, 2 * b * d, b * d)] * 2 + [(5 * inter, 3 * b * inter, 0)]  # 2 RMSNorms, SiLU-mul
        lm_head = [_linear_op(d, shape.vocab / tp, b)]
        # Token-level operators, one row each: F = n * f, B = n * bytes_per_token + fixed_bytes.
        table = np.array(linear + norm_act + lm_head, dtype=float)
        self._tok_f, self._tok_bt, self._tok_bf = (table[:, i:i + 1] for i in range(3))
        self._tok_is_lm_head = np.arange(len(table))[:, None] == len(table) - 1
        # Sums the rows into the Breakdown fields linear, norm_act, lm_head; layer ops count L times.
        self._tok_groups = np.zeros((3, len(table)))
        self._tok_groups[0, :4] = self._tok_groups[1, 4:7] = shape.layers
        self._tok_groups[2, 7] = 1

        grid = np.arange(1, profile.num_sms + 1)
        self._pi = np.concatenate(([np.nan], profile.compute_rate(grid)))
        self._bw = np.concatenate(([np.nan], profile.bandwidth(grid)))
        self._pi_attention = self._pi * profile.attention_efficiency
        self._pi_tokens = self._pi * profile.gemm_efficiency

    def predict(self, reqs: Sequence[Request] | np.ndarray, sms: int, lm_head_tokens: int | None = None,
                graphs: bool | None = None, host: bool = True) -> Breakdown:
        """Predicted seconds, by operator class, of one forward pass of ``reqs`` on ``sms`` SMs.

        ``reqs``: (q, c) per request (or an (R, 2) integer array); ``lm_head_tokens``
        overrides how many tokens go through lm_head; ``graphs`` says whether the iteration is
        replayed from CUDA graphs (None: decode-only batches are when ``cuda_graphs``);
        ``host=False`` leaves out the serving host time (module docstring), e.g. to compare
        with GPU time alone. Raises ValueError for q < 1, c < 0, or ``sms`` outside 1..num_sms.
        """
        parts = self._components([_columns(reqs)], np.asarray([sms]), lm_head_tokens, graphs, host)[:, 0]
        return Breakdown(*(float(x) for x in parts))

    def predict_total(self, reqs: Sequence[Request] | np.ndarray, sms: ArrayLike,
                      lm_head_tokens: int | None = None, graphs: bool | None = None,
                      host: bool = True) -> np.ndarray:
        """Predicted iteration seconds of ``reqs`` for each SM count in ``sms`` (int or array).

        Same arguments and errors as ``predict``; ``host=False`` leaves out the host time
        (module docstring). Returns an array shaped like ``sms``.
        """
        s = np.asarray(sms)
        parts = self._components([_columns(reqs)], s.reshape(-1), lm_head_tokens, graphs, host)
        return parts.sum(axis=0).reshape(s.shape)

    def predict_variants(self, fixed_reqs: Sequence[Request] | np.ndarray, q: np.ndarray, c: np.ndarray,
                         sms: int) -> np.ndarray:
        """Predicted seconds on ``sms`` SMs of M variants of one batch: ``fixed_reqs`` (q, c)
        run in every variant; J more requests with ``c`` (J,) cached tokens run ``q`` (J, M)
        query tokens in variant m, 0 where a request sits it out. lm_head counts follow the
        ``lm_head`` mode, CUDA graphs the default rule per variant. Sizes prefill chunks (the
        optimizer's fallback). Returns M seconds.

        Raises ValueError for invalid ``fixed_reqs``, negative ``q`` or ``c``, or ``sms``
        outside 1..num_sms.
        """
        q, c = np.asarray(q, dtype=np.int64), np.asarray(c, dtype=np.int64)
        if q.size and (q.min() < 0 or c.min() < 0):
            raise ValueError("token counts must be >= 0")
        return self._components([_columns(fixed_reqs), (q, c[:, None])], np.asarray([sms]), None, None).sum(axis=0)

    def predict_steps(self, reqs: Sequence[Request] | np.ndarray, sms: int, steps: int) -> float:
        """Seconds of ``steps`` decode steps of ``reqs`` run back to back on ``sms`` SMs (multi-step
        decode): the GPU time of every step, the host time once, as each later step's host work
        runs while the step before it is on the GPU (module docstring; measured on the H200,
        tenth session: 4-step iterations ran 0.92x ``steps`` whole steps, 1.00x this).

        Raises ValueError as ``predict``, or for ``steps < 1``.
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        gpu = float(self.predict_total(reqs, sms, host=False))
        return steps * gpu + float(self.predict_total(reqs, sms)) - gpu

    def predict_spatial(self, decode_reqs: Sequence[Request] | np.ndarray,
                        prefill_reqs: Sequence[Request] | np.ndarray,
                        s_decode: ArrayLike, total_sms: int) -> tuple[np.ndarray, np.ndarray]:
        """Seconds of one decode step on ``s_decode`` SMs and of the prefill batch on
        ``total_sms - s_decode`` SMs, when both run at once (a spatial plan).

        Decode is scaled by the profile's ``decode_interference`` times ``decode_margin`` times
        ``decode_level_scale[s_decode]``, prefill by ``prefill_interference`` times ``prefill_scale`` (docs/design.md section 5); decode is replayed from graphs
        when ``cuda_graphs`` (the engine records them per split level) and its steps carry no
        host time (module docstring); the prefill runs eagerly (no piecewise graphs on a split)
        and carries its host time unscaled. Returns (t_decode,
        t_prefill), arrays shaped like ``s_decode``. Raises ValueError as ``predict``.
        """
        s_d = np.asarray(s_decode)
        t_d = self.predict_total(decode_reqs, s_d, host=False) * (self.profile.decode_interference * self.decode_margin
                                                                   * self.decode_level_scale[s_d])
        t_p = self.predict_total(prefill_reqs, total_sms - s_d, graphs=False, host=False) * (self.profile.prefill_interference *
                                                                               self.prefill_scale)
        prefill = _columns(prefill_reqs)[0]
        if len(prefill):  # the prefill's host time (eager), not scaled by the GPU's interference
            t_p = t_p + len(prefill) * self.profile.host_per_request_s + self.profile.host_eager_s
        return t_d, t_p

    def _components(self, groups: list[tuple[np.ndarray, np.ndarray]], sms: np.ndarray,
                    lm_head_tokens: int | None, graphs: bool | None, host: bool = True) -> np.ndarray:
        """Rows linear, attention, norm_act, communication, lm_head, overhead; one column per variant.

        ``groups`` hold the batch's requests as (q, c) with q (R, X) or (R, 1) and c (R, 1);
        ``sms`` is (X,) or (1,). The columns are one batch on X SM counts, or X variants of
        a batch on one SM count (a group with q (R, 1) takes part in every variant).
        ``graphs`` as in ``predict``, ``host`` as in ``predict_total``.
        """
        if sms.dtype.kind not in "iu" or sms.min() < 1 or sms.max() > self.profile.num_sms:
            raise ValueError(f"SM counts must be integers in 1..{self.profile.num_sms}, got {sms}")
        pi, bw = self._pi[sms], self._bw[sms]
        # Each group separately, its (1,) sums broadcast over the columns: a group in every
        # variant (the decodes beside trimmed prefills) is summed once, not once a column.
        # The planner calls this several times an iteration on arrays of a few columns, where
        # numpy's cost is per operation: the sums start from Python zeros and broadcast.
        n, requests, prefill, attention = 0, 0, False, 0.0
        for q, c in groups:
            n = n + q.sum(axis=0)
            requests = requests + (q > 0).sum(axis=0)
            prefill = prefill | (q > 1).any(axis=0)
            attention = attention + self._attention_time(q, c, self._pi_attention[sms], bw)
        if lm_head_tokens is not None:
            lm_tokens = np.asarray(lm_head_tokens)
        else:
            lm_tokens = n if self.lm_head == "all" else requests
        tokens = np.where(self._tok_is_lm_head, lm_tokens, n)
        token_ops = np.maximum(tokens * self._tok_f / self._pi_tokens[sms], (tokens * self._tok_bt + self._tok_bf) / bw) * (tokens > 0)
        parts = np.empty((6, token_ops.shape[1]))
        parts[[0, 2, 4]] = self._tok_groups @ token_ops  # linear, norm_act, lm_head
        parts[1] = self.shape.layers * attention
        parts[3] = self.shape.layers * self._allreduce_time(n, pi) if self.tp > 1 else 0.0
        parts[5] = self._overhead(parts[:5].sum(axis=0), ~prefill, requests, n, graphs, host)
        return parts

    def _overhead(self, roofline: np.ndarray, decode_only: np.ndarray, requests: np.ndarray, tokens: np.ndarray,
                  graphs: bool | None, host: bool) -> np.ndarray:
        """Seconds the per-kernel and host model adds to each column's ``roofline`` seconds
        (module docstring): ``n g`` replayed from graphs, ``max(roofline + n g, n' h) - roofline``
        eager, with ``n`` the column's count (``HardwareProfile.iteration_kernels``: graph
        decodes of at most ``narrow_decode_batch`` requests have their own) and ``n'`` its host
        launches (``n``, or the ``"piecewise"`` count for a column of at most ``piecewise_tokens``
        ``tokens`` with prefill), plus with ``host`` the host time of the column's ``requests``
        (``host_piecewise_s`` in place of ``host_eager_s`` for such a piecewise column); an empty
        column launches nothing."""
        p = self.profile
        replayed = decode_only & self.cuda_graphs if graphs is None else np.full(decode_only.shape, graphs)
        kernels = p.iteration_kernels(self.shape.layers, decode_only, replayed, requests) * (requests > 0)
        piecewise = np.zeros(decode_only.shape, dtype=bool)
        launches = kernels
        if graphs is None and self.cuda_graphs and self.piecewise_tokens and PIECEWISE in p.kernels_per_layer:
            piecewise = ~decode_only & (tokens <= self.piecewise_tokens)
            launches = np.where(piecewise, p.kernel_count(PIECEWISE, self.shape.layers), kernels) * (requests > 0)
        launch = kernel_bound(roofline, kernels, launches, replayed, p.kernel_gpu_s, p.launch_cpu_s) - roofline
        served = requests * host
        eager_host = np.where(piecewise, p.piecewise_host_s, p.host_eager_s) * ~replayed
        return launch + (served * p.host_per_request_s + eager_host) * (served > 0)

    def _attention_time(self, q: np.ndarray, c: np.ndarray, pi_attention: np.ndarray, bw: np.ndarray) -> np.ndarray:
        """One layer: the sum over requests (rows) of max(F_r/Pi_a, B_r/BW), per column, with
        ``pi_attention`` Pi(S) times the profile's ``attention_efficiency``. Requests with q = 0
        cost nothing."""
        qf = q.astype(float)
        dh, b = self.shape.head_dim, self.dtype_bytes
        pairs = qf * c + qf * (qf + 1) / 2 if self.causal else qf * (qf + c)
        flops = (4 * dh + 2) * self._hq * pairs
        nbytes = (b * dh) * (2 * self._hq * qf + 2 * self._hkv * (qf + c)) * (q > 0)
        return np.maximum(flops / pi_attention, nbytes / bw).sum(axis=0)

    def _allreduce_time(self, n: np.ndarray, pi: np.ndarray) -> np.ndarray:
        """Two all-reduces of the block output per layer (docs/design.md section 3), for tp > 1."""
        N, p = self.tp, self.profile
        out_bytes = n * self.shape.hidden * self.dtype_bytes
        one = 2 * (N - 1) * p.allreduce_alpha_s + 2 * (N - 1) * out_bytes / (N * p.nvlink_bandwidth) \
            + N * (N - 1) * out_bytes / pi
        return 2 * one * (n > 0)


def kernel_bound(roofline: ArrayLike, kernels: ArrayLike, launches: ArrayLike, replayed: ArrayLike,
                 kernel_gpu_s: float, launch_cpu_s: float) -> np.ndarray:
    """Seconds of iterations of ``roofline`` seconds that run ``kernels`` kernels, ``launches`` of
    them launched from the host when not ``replayed`` from CUDA graphs: ``r + n g`` replayed,
    ``max(r + n g, n' h)`` eager (the GPU or the launching host, whichever is slower; module
    docstring, "Per-kernel overheads"). Arrays broadcast together."""
    gpu = np.asarray(roofline, dtype=float) + np.asarray(kernels, dtype=float) * kernel_gpu_s
    return np.where(np.asarray(replayed, dtype=bool), gpu,
                    np.maximum(gpu, np.asarray(launches, dtype=float) * launch_cpu_s))


def _columns(reqs: Sequence[Request] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, c) of a request list as (R, 1) columns; raises ValueError unless q >= 1 and c >= 0."""
    arr = np.asarray(reqs, dtype=np.int64).reshape(-1, 2)
    if arr.size and (arr[:, 0].min() < 1 or arr[:, 1].min() < 0):
        raise ValueError("every request needs q >= 1 new tokens and c >= 0 cached tokens")
    return arr[:, :1], arr[:, 1:]
