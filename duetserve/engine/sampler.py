"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from duetserve.engine.upload import upload
from duetserve.model.fused_ops import FUSED_ENV, fused_mode, triton_module
from duetserve.sampling import SamplingParams


def _kernels() -> ModuleType | None:
    """``duetserve.engine.triton_sampler`` (``fused_ops.triton_module``)."""
    return triton_module("duetserve.engine.triton_sampler", "sampling with torch")


def use_race_kernel(device: torch.device) -> bool:
    """Whether a ``Sampler`` on ``device`` samples with the Triton race kernel: on CUDA where triton
    imports; ``DUETSERVE_FUSED`` (``duetserve.model.fused_ops``) 0 never, 1 always (on a CPU only
    under ``TRITON_INTERPRET=1``, for tests). A ``Sampler`` reads this once, when it is built.

    Raises:
        ValueError: a ``DUETSERVE_FUSED`` other than 0, 1, auto.
        RuntimeError: ``DUETSERVE_FUSED=1`` but triton does not import.
    """
    mode = fused_mode()
    if mode == "1" and _kernels() is None:
        raise RuntimeError(f"{FUSED_ENV}=1 but triton does not import")
    return mode == "1" or (mode == "auto" and device.type == "cuda" and _kernels() is not None)


@dataclass
class SamplingBatch:
    """Device-side sampling parameters of a batch of ``n`` rows, built once (host-to-device copies
    queued without a sync).

    Attributes:
        rows: ``[m]`` int64, rows sampled by the torch path: every random row, or with ``race``
            only those that use top-k or top-p. None: no such row.
        temperature: ``[m, 1]`` float32.
        top_k: ``[m]`` int64 (vocab size where disabled), or None if no row uses top-k.
        top_p: ``[m, 1]`` float32, or None if no row uses top-p.
        generators: ``m`` generators (a seeded request has its own).
        race: the race kernel's ``([n] float32 temperatures, 0 (the argmax) for greedy rows and for
            ``rows``; [n] int64 seeds)`` for all rows (``use_race_kernel``), or None (greedy rows
            take ``torch.argmax``).
    """

    rows: torch.Tensor | None
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    generators: list[torch.Generator]
    race: tuple[torch.Tensor, torch.Tensor] | None = None


class Sampler:
    """Picks one token per row of a logits matrix, without a host sync until the caller reads it.

    Greedy rows take the argmax. Other rows are scaled by temperature, filtered by top-k and
    top-p (the smallest set of tokens whose probability reaches ``top_p``), and sampled with
    the exponential-race trick (``argmax(p / E)``, ``E ~ Exp(1)``, taken on the logits ``z`` as
    ``argmax(z - log E)``). Two paths:

    - the race kernel (``use_race_kernel``: on CUDA) samples every row without top-k or top-p in
      two launches (``duetserve.engine.triton_sampler``), its draws keyed by the request's seed (its
      own, or one the sampler drew for it from ``seed``) and the position of the token;
    - torch samples the other random rows (all of them on a CPU), drawing ``E`` from the request's
      own generator (seeded requests) or the sampler's.

    Either way a seeded request repeats whatever batch it is in.
    """

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}
        self.race = use_race_kernel(device)
        self._rng = np.random.default_rng(seed)
        self._seeds: dict[int, int] = {}  # the race kernel's seed of each unseeded request

    def generator_for(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_generator
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = self._generators[seq_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return gen

    def seed_for(self, seq_id: int, params: SamplingParams) -> int:
        """The race kernel's seed of a request: its own, or one drawn for it on first use."""
        if params.seed is not None:
            return params.seed
        seed = self._seeds.get(seq_id)
        if seed is None:
            seed = self._seeds[seq_id] = int(self._rng.integers(2**63))
        return seed

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)
        self._seeds.pop(seq_id, None)

    def prepare(self, seq_ids: list[int], params: list[SamplingParams], vocab_size: int) -> SamplingBatch:
        """Upload the batch's sampling parameters (copies from pinned memory, queued on the
        current stream; call before launching the steps that use them)."""
        race = None
        filtered = [0 < p.top_k < vocab_size or p.top_p < 1.0 for p in params]  # rows that need the torch path
        if self.race and any(not p.greedy for p in params):
            # the torch path's rows take the kernel's cheaper argmax, then are overwritten
            (temps,) = upload([[0.0 if p.greedy or f else p.temperature for p, f in zip(params, filtered)]],
                              torch.float32, self.device)
            (seeds,) = upload([[self.seed_for(i, p) for i, p in zip(seq_ids, params)]], torch.int64, self.device)
            race = (temps, seeds)
        rows = [i for i, (p, f) in enumerate(zip(params, filtered)) if not p.greedy and (race is None or f)]
        if not rows:
            return SamplingBatch(None, None, None, None, [], race)
        sub = [params[i] for i in rows]
        use_k, use_p = any(0 < p.top_k < vocab_size for p in sub), any(p.top_p < 1.0 for p in sub)
        rows_t, top_k = upload([rows, [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in sub]],
                               torch.int64, self.device)
        temperature, top_p = upload([[p.temperature for p in sub], [p.top_p for p in sub]], torch.float32, self.device)
        return SamplingBatch(rows_t, temperature[:, None], top_k if use_k else None, top_p[:, None] if use_p else None,
                             [self.generator_for(seq_ids[i], params[i]) for i in rows], race)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids ``[n]`` (int64, on the device) from ``logits`` ``[n, vocab]`` (float32, bf16 or fp16;
        the random rows are sampled in float32).

        ``positions``: ``[n]`` int64, the position of the token each row samples from, which keys
        the race kernel's draws (``batch.race``).

        Raises:
            ValueError: ``batch.race`` without ``positions``.
        """
        if batch.race is not None:
            if positions is None:
                raise ValueError("the race kernel samples by position: pass the rows' positions")
            out = _kernels().race_sample(logits, *batch.race, positions)
        else:
            out = logits.argmax(dim=-1)
        if batch.rows is None:
            return out
        sub = logits.index_select(0, batch.rows).float() / batch.temperature
        if batch.top_k is not None:
            kth = sub.sort(dim=-1, descending=True).values.gather(1, (batch.top_k - 1)[:, None])
            sub = sub.masked_fill(sub < kth, float("-inf"))
        if batch.top_p is not None:
            sub = _top_p(sub, batch.top_p)
        race = torch.empty_like(sub).exponential_(generator=self.default_generator)  # one draw for all rows
        for j, g in enumerate(batch.generators):
            if g is not self.default_generator:  # a seeded request draws from its own generator
                race[j].exponential_(generator=g)
        # argmax(p / E) = argmax(log p - log E), and log p = sub - logsumexp(sub) with one logsumexp a row:
        # the race runs on the logits, no softmax (at 8 rows it took 39 us of a 5 ms step on the H200)
        return out.index_copy(0, batch.rows, (sub - race.log_()).argmax(dim=-1))

    def __call__(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams],
                 positions: torch.Tensor | None = None) -> list[int]:
        """Sample and read the tokens back (one host sync)."""
        return self.sample(logits, self.prepare(seq_ids, params, logits.shape[-1]), positions).tolist()


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside the smallest set whose probability reaches ``top_p`` ``[n, 1]``."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches p
    drop[:, 0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
