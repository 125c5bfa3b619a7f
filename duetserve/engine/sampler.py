"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import torch

from duetserve.sampling import SamplingParams


class Sampler:
    """Picks one token per row of a logits matrix.

    Greedy rows take the argmax. Other rows are scaled by temperature, filtered by top-k and
    top-p (the smallest set of tokens whose probability reaches ``top_p``), and sampled with
    the exponential-race trick (``argmax(p / E)``, ``E ~ Exp(1)``), drawing ``E`` from the
    request's own generator so a seeded request repeats whatever batch it is in.
    """

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}

    def generator_for(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_generator
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = self._generators[seq_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return gen

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def __call__(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]) -> list[int]:
        """Sample from ``logits`` ``[n, vocab]`` (float32); returns n token ids."""
        out = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            sub = logits[idx] / torch.tensor([params[i].temperature for i in rows], device=logits.device)[:, None]
            sub = _top_k(sub, [params[i].top_k for i in rows])
            sub = _top_p(sub, [params[i].top_p for i in rows])
            probs = sub.softmax(dim=-1)
            race = torch.stack([torch.empty_like(probs[j]).exponential_(generator=self.generator_for(seq_ids[i], params[i]))
                                for j, i in enumerate(rows)])
            out[idx] = (probs / race).argmax(dim=-1)
        return out.tolist()


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    if all(k <= 0 for k in ks):
        return logits
    vocab = logits.shape[-1]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    p = torch.tensor(ps, device=logits.device)[:, None]
    drop = cum - sorted_logits.softmax(dim=-1) >= p  # mass before this token already reaches p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
