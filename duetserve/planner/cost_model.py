"""Attention-aware roofline cost model (DESIGN section 3; DuetServe paper section 4.1).

Every operator costs ``t = max(F / Pi(S), B / BW(S))`` seconds, with F its FLOPs, B the
bytes it moves and Pi, BW the rates of S SMs from a ``HardwareProfile``. A transformer
block is the sum of its operators; the model is ``layers * t_block + t_lm_head``.

Operators per block (one decoder layer of the Llama / Qwen3 family, per GPU under TP):

* linear (token-level): qkv, o, gate+up, down, with ``F = 2 n d_i d_o`` and
  ``B = b (n d_i + d_i d_o + n d_o)`` for ``n`` batch tokens and ``b`` bytes per element;
* norm_act (token-level): two RMSNorms (``F = 4 n d``, ``B = b (2 n d + d)``) and the
  SiLU-and-multiply (``F = 5 n i``, ``B = 3 b n i``). Residual adds, RoPE and Qwen3's q/k
  norms are taken as fused into neighbouring kernels and not counted;
* attention (sequence-level), per request with ``q`` new and ``c`` cached tokens:
  ``F = (4 d_h + 2) h_q P`` and ``B = b (2 h_q q d_h + 2 h_kv (q + c) d_h)`` where ``P`` is
  the number of (query, key) pairs computed; the batch's time is the sum of each request's
  roofline time;
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
``lm_head="all"`` it runs over every query token, as the seed ``000_...txt`` estimate does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from duetserve.planner.hardware import HardwareProfile

Request = tuple[int, int]
"""One request in a batch: (q new/query tokens, c cached tokens). q=1 decode, c=0 prefill."""

_PRESET_CONFIGS: dict[str, dict[str, object]] = {
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                      head_dim=128, intermediate_size=17408, vocab_size=151936, tie_word_embeddings=False),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama/Qwen3-family decoder that the cost model needs.

    ``hidden``, ``head_dim`` and ``intermediate`` are element counts, ``vocab`` tokens.
    """

    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object]) -> "ModelShape":
        """Build from a Hugging Face ``config.json`` dict.

        ``num_key_value_heads`` defaults to the query heads, ``head_dim`` to
        ``hidden_size // num_attention_heads``, ``tie_word_embeddings`` to False.
        Raises ValueError naming the first missing required key.
        """
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        for key in required:
            if key not in config:
                raise ValueError(f"config has no {key!r}")
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            q_heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """Shapes of known models: ``qwen3-8b``, ``qwen3-14b``, ``llama3-8b``, ``smollm2-135m``
        (values from their published config.json). Raises ValueError for other names."""
        if name.lower() not in _PRESET_CONFIGS:
            raise ValueError(f"unknown model preset {name!r}; known {sorted(_PRESET_CONFIGS)}")
        return cls.from_hf_config(_PRESET_CONFIGS[name.lower()])


@dataclass(frozen=True)
class Breakdown:
    """Predicted seconds of one forward pass, by operator class (all layers summed)."""

    linear: float
    attention: float
    norm_act: float
    communication: float
    lm_head: float

    @property
    def total(self) -> float:
        """Predicted iteration time in seconds."""
        return self.linear + self.attention + self.norm_act + self.communication + self.lm_head


class _TokenOps:
    """Token-level operators as ``F = n * flops_per_token``, ``B = n * bytes_per_token + fixed_bytes``."""

    def __init__(self, flops_per_token: Sequence[float], bytes_per_token: Sequence[float],
                 fixed_bytes: Sequence[float]) -> None:
        self.f = np.asarray(flops_per_token, dtype=float)[:, None]
        self.bt = np.asarray(bytes_per_token, dtype=float)[:, None]
        self.bf = np.asarray(fixed_bytes, dtype=float)[:, None]

    @classmethod
    def linears(cls, dims: Sequence[tuple[float, float]], b: int) -> "_TokenOps":
        """Linear layers ``(d_i, d_o)``: F = 2 n d_i d_o, B = b (n d_i + d_i d_o + n d_o)."""
        return cls([2 * di * do for di, do in dims], [b * (di + do) for di, do in dims],
                   [b * di * do for di, do in dims])

    def time(self, n: float, pi: np.ndarray, bw: np.ndarray) -> np.ndarray:
        """Sum over the operators of max(F/Pi, B/BW), for each S in the rate arrays."""
        if n == 0:
            return np.zeros_like(pi)
        return np.maximum(n * self.f / pi, (n * self.bt + self.bf) / bw).sum(axis=0)


class CostModel:
    """Roofline latency predictor for one model on one GPU type (DESIGN section 3).

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
            decode on few SMs (DESIGN section 3, Chinese seed section 5: underestimating
            decode starves prefill, overestimating only wastes a little decode time).

    Raises:
        ValueError: on non-positive sizes, heads not divisible by ``tp``, an unknown
            ``lm_head`` mode or ``decode_margin < 1``.

    Rates for every integer S in 1..num_sms are computed once here, so predictions only
    index arrays; ``predict_total`` evaluates many S at once for the optimizer.
    """

    def __init__(self, shape: ModelShape, profile: HardwareProfile, dtype_bytes: int = 2, tp: int = 1,
                 causal: bool = True, lm_head: Literal["last", "all"] = "last",
                 decode_margin: float = 1.0) -> None:
        if dtype_bytes <= 0 or tp <= 0:
            raise ValueError("dtype_bytes and tp must be positive")
        if shape.q_heads % tp or shape.intermediate % tp or (shape.kv_heads >= tp and shape.kv_heads % tp):
            raise ValueError(f"heads and intermediate of {shape} do not split {tp} ways")
        if lm_head not in ("last", "all"):
            raise ValueError(f"lm_head must be 'last' or 'all', got {lm_head!r}")
        if decode_margin < 1.0:
            raise ValueError("decode_margin must be >= 1")
        self.shape, self.profile, self.tp = shape, profile, tp
        self.dtype_bytes, self.causal, self.lm_head, self.decode_margin = dtype_bytes, causal, lm_head, decode_margin

        b, d, dh = dtype_bytes, shape.hidden, shape.head_dim
        self._hq = shape.q_heads // tp
        self._hkv = max(1, shape.kv_heads // tp)
        inter = shape.intermediate // tp
        self._linear = _TokenOps.linears(
            [(d, (self._hq + 2 * self._hkv) * dh), (self._hq * dh, d), (d, 2 * inter), (inter, d)], b)
        self._norm_act = _TokenOps([4 * d, 4 * d, 5 * inter], [2 * b * d, 2 * b * d, 3 * b * inter],
                                   [b * d, b * d, 0])
        self._lm_head = _TokenOps.linears([(d, shape.vocab / tp)], b)

        grid = np.arange(1, profile.num_sms + 1)
        self._pi = np.concatenate(([np.nan], profile.compute_rate(grid)))
        self._bw = np.concatenate(([np.nan], profile.bandwidth(grid)))

    def predict(self, reqs: Sequence[Request] | np.ndarray, sms: int, lm_head_tokens: int | None = None) -> Breakdown:
        """Predicted seconds, by operator class, of one forward pass of ``reqs`` on ``sms`` SMs.

        ``reqs``: (q, c) per request (or an (R, 2) integer array); ``lm_head_tokens``
        overrides how many tokens go through lm_head. Raises ValueError for q < 1, c < 0,
        or ``sms`` outside 1..num_sms.
        """
        parts = self._components(reqs, np.asarray([sms]), lm_head_tokens)[:, 0]
        return Breakdown(*(float(x) for x in parts))

    def predict_total(self, reqs: Sequence[Request] | np.ndarray, sms: ArrayLike,
                      lm_head_tokens: int | None = None) -> np.ndarray:
        """Predicted iteration seconds of ``reqs`` for each SM count in ``sms`` (int or array).

        Same arguments and errors as ``predict``; returns an array shaped like ``sms``.
        """
        s = np.asarray(sms)
        return self._components(reqs, s.reshape(-1), lm_head_tokens).sum(axis=0).reshape(s.shape)

    def predict_spatial(self, decode_reqs: Sequence[Request] | np.ndarray,
                        prefill_reqs: Sequence[Request] | np.ndarray,
                        s_decode: ArrayLike, total_sms: int) -> tuple[np.ndarray, np.ndarray]:
        """Seconds of one decode step on ``s_decode`` SMs and of the prefill batch on
        ``total_sms - s_decode`` SMs, when both run at once (a spatial plan).

        Decode is scaled by the profile's ``decode_interference`` times ``decode_margin``,
        prefill by ``prefill_interference`` (DESIGN section 5). Returns (t_decode, t_prefill),
        arrays shaped like ``s_decode``. Raises ValueError as ``predict``.
        """
        s_d = np.asarray(s_decode)
        t_d = self.predict_total(decode_reqs, s_d) * (self.profile.decode_interference * self.decode_margin)
        t_p = self.predict_total(prefill_reqs, total_sms - s_d) * self.profile.prefill_interference
        return t_d, t_p

    def _components(self, reqs: Sequence[Request] | np.ndarray, sms: np.ndarray,
                    lm_head_tokens: int | None) -> np.ndarray:
        """Rows linear, attention, norm_act, communication, lm_head; one column per S."""
        if sms.size and (not np.issubdtype(sms.dtype, np.integer) or sms.min() < 1
                         or sms.max() > self.profile.num_sms):
            raise ValueError(f"SM counts must be integers in 1..{self.profile.num_sms}, got {sms}")
        arr = np.asarray(reqs, dtype=np.int64).reshape(-1, 2)
        q, c = arr[:, 0], arr[:, 1]
        if arr.size and (q.min() < 1 or c.min() < 0):
            raise ValueError("every request needs q >= 1 new tokens and c >= 0 cached tokens")
        pi, bw = self._pi[sms], self._bw[sms]
        n = int(q.sum())
        if lm_head_tokens is None:
            lm_head_tokens = n if self.lm_head == "all" else len(q)
        layers = self.shape.layers
        out = np.empty((5, sms.size))
        out[0] = layers * self._linear.time(n, pi, bw)
        out[1] = layers * self._attention_time(q, c, pi, bw)
        out[2] = layers * self._norm_act.time(n, pi, bw)
        out[3] = layers * self._allreduce_time(n, pi)
        out[4] = self._lm_head.time(lm_head_tokens, pi, bw)
        return out

    def _attention_time(self, q: np.ndarray, c: np.ndarray, pi: np.ndarray, bw: np.ndarray) -> np.ndarray:
        """One layer: sum over requests of max(F_r/Pi, B_r/BW), for each S.

        A request is compute-bound at S exactly when its intensity F_r/B_r exceeds
        Pi(S)/BW(S); with requests sorted by intensity and prefix sums of F and B, each S
        costs one binary search instead of a pass over the requests.
        """
        if q.size == 0:
            return np.zeros_like(pi)
        qf, cf = q.astype(float), c.astype(float)
        dh, b = self.shape.head_dim, self.dtype_bytes
        pairs = qf * cf + qf * (qf + 1) / 2 if self.causal else qf * (qf + cf)
        flops = (4 * dh + 2) * self._hq * pairs
        nbytes = b * dh * (2 * self._hq * qf + 2 * self._hkv * (qf + cf))
        order = np.argsort(flops / nbytes)
        intensity = (flops / nbytes)[order]
        cum_f = np.concatenate(([0.0], np.cumsum(flops[order])))
        cum_b = np.concatenate(([0.0], np.cumsum(nbytes[order])))
        memory_bound = np.searchsorted(intensity, pi / bw, side="right")
        return cum_b[memory_bound] / bw + (cum_f[-1] - cum_f[memory_bound]) / pi

    def _allreduce_time(self, n: int, pi: np.ndarray) -> np.ndarray:
        """Two all-reduces of the block output per layer (DESIGN section 3), 0 when tp == 1."""
        if self.tp == 1 or n == 0:
            return np.zeros_like(pi)
        N, p = self.tp, self.profile
        out_bytes = n * self.shape.hidden * self.dtype_bytes
        one = 2 * (N - 1) * p.allreduce_alpha_s + 2 * (N - 1) * out_bytes / (N * p.nvlink_bandwidth) \
            + N * (N - 1) * out_bytes / pi
        return 2 * one
