"""The race kernel (``duetserve.engine.triton_sampler``) and the ``Sampler`` path that uses it.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set for this
module's tests only); the ``gpu`` test runs them on CUDA beside the torch path.
"""
from __future__ import annotations

import pytest
import torch
from conftest import CUDA, import_triton_module

from duetserve.engine.sampler import Sampler
from duetserve.model.fused_ops import FUSED_ENV
from duetserve.sampling import SamplingParams

DEVICE = torch.device("cuda" if CUDA else "cpu")
ts = import_triton_module("duetserve.engine.triton_sampler")
pytestmark = pytest.mark.usefixtures("triton_interpreter")


def race(logits, temperature, seeds, positions):
    def t(values, dtype):
        return torch.tensor(values, dtype=dtype, device=DEVICE)
    return ts.race_sample(logits.to(DEVICE), t(temperature, torch.float32), t(seeds, torch.int64),
                          t(positions, torch.int64)).tolist()


def test_greedy_rows_take_the_first_maximum_across_quarters_and_tiles():
    vocab = 2 * ts.TILE + 1000  # three tiles, the last one partial
    quarter = ts.TILE // 4
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, [quarter + 5, 3 * quarter + 7]] = 9.0  # two quarters of tile 0: the earlier wins
    logits[1, [ts.TILE + 3, 2 * ts.TILE + 900]] = 9.0  # two tiles: the earlier wins
    logits[2, vocab - 1] = 9.0  # the last column of the partial tile
    logits[3, 0] = 9.0
    assert race(logits, [0.0] * 4, [1] * 4, [0] * 4) == [quarter + 5, ts.TILE + 3, vocab - 1, 0]


def test_sampled_tokens_follow_the_softmax_at_the_temperature():
    # 1000 draws (one program each under the interpreter, about 13 s); the GPU test below takes 4096
    # at temperature 1. At 0.5 the softmax is p^2 normalised: 0.66 / 0.24 / 0.11, far from p.
    n, temperature = 1000, 0.5
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.full((n, 1500), float("-inf"))  # entries outside the three can never win
    logits[:, 1000:1003] = torch.log(probs)
    tokens = torch.tensor(race(logits, [temperature] * n, list(range(n)), [7] * n))
    freq = torch.bincount(tokens - 1000, minlength=3).float() / n
    want = torch.softmax(torch.log(probs) / temperature, dim=0)
    assert torch.allclose(freq, want, atol=0.04), (freq, want)  # 2.7 standard deviations at 0.66


def test_a_draw_depends_only_on_the_seed_and_the_position():
    logits = torch.zeros(1, 1000).repeat(4, 1)  # uniform: the draw alone decides
    a = race(logits, [1.0] * 4, [11, 22, 11, 33], [5, 5, 6, 5])
    b = race(logits[:2], [1.0, 1.0], [33, 11], [5, 5])  # the same requests, another batch and order
    assert (b[0], b[1]) == (a[3], a[0])
    many = race(torch.zeros(1, 1000).repeat(60, 1), [1.0] * 60, [11] * 60, list(range(60)))
    assert len(set(many)) > 50  # a new draw at every position
    seeds = race(torch.zeros(1, 1000).repeat(60, 1), [1.0] * 60, list(range(60)), [5] * 60)
    assert len(set(seeds)) > 50  # and for every seed


def test_every_column_draws_its_own_number_across_quarters_and_tiles():
    """Eight columns with equal logits, one at the same offset in each quarter of two tiles: each
    wins about an eighth of the draws. Had two of them shared a Philox output (a quarter reusing
    another's, or a tile another tile's counter), their keys would tie every time and the later
    column would never win."""
    n, offset, quarter = 320, 100, ts.TILE // 4
    columns = [tile * ts.TILE + q * quarter + offset for tile in (0, 1) for q in range(4)]
    logits = torch.full((n, 2 * ts.TILE), float("-inf"))
    logits[:, columns] = 0.0
    wins = torch.tensor(race(logits, [1.0] * n, list(range(n)), [9] * n))
    counts = [(wins == c).sum().item() for c in columns]
    assert sum(counts) == n and min(counts) >= 20, counts  # 40 expected each


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="seeds must be"):
        ts.race_sample(torch.zeros(2, 10), torch.ones(2), torch.ones(3, dtype=torch.int64),
                       torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions must be"):
        ts.race_sample(torch.zeros(2, 10), torch.ones(2), torch.ones(2, dtype=torch.int64),
                       torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        ts.race_sample(torch.zeros(10, 2).t(), torch.ones(2), torch.ones(2, dtype=torch.int64),
                       torch.ones(2, dtype=torch.int64))


def test_sampler_mixes_the_race_kernel_with_the_torch_filters(monkeypatch):
    monkeypatch.setenv(FUSED_ENV, "1")
    sampler = Sampler(DEVICE, seed=0)
    assert sampler.race
    vocab = 3000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=1)]
    batch = sampler.prepare(list(range(5)), params, vocab)
    assert batch.rows.tolist() == [2]  # only the top-k row goes through torch
    positions = torch.tensor([10, 20, 30, 40, 50], device=DEVICE)
    top3 = set(logits[2].topk(3).indices.tolist())
    for _ in range(20):
        got = sampler.sample(logits, batch, positions).tolist()
        assert got[0] == logits[0].argmax().item() and got[4] == logits[4].argmax().item()
        assert got[2] in top3
    # the seeded request gives the same token alone, at the same position
    alone = Sampler(DEVICE, seed=99)(logits[1:2], [7], [params[1]], positions[1:2])
    assert alone == [got[1]]
    with pytest.raises(ValueError, match="positions"):
        sampler.sample(logits, batch)
    # unseeded requests keep the seed drawn for them until released
    first = sampler.seed_for(3, params[3])
    assert sampler.seed_for(3, params[3]) == first
    sampler.release(3)
    assert sampler.seed_for(3, params[3]) != first


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_race_kernel_on_the_gpu_matches_the_distribution_at_the_vocab_size():
    n, vocab = 4096, 151936
    probs = torch.tensor([0.6, 0.25, 0.15])
    logits = torch.full((n, vocab), -30.0, device="cuda")
    logits[:, [5, 80000, vocab - 1]] = torch.log(probs).cuda()
    tokens = race(logits, [1.0] * n, list(range(n)), [3] * n)
    freq = torch.tensor([tokens.count(c) for c in (5, 80000, vocab - 1)]).float() / n
    assert torch.allclose(freq, probs, atol=0.03), freq
    greedy = torch.randn(64, vocab, device="cuda")
    assert race(greedy, [0.0] * 64, [0] * 64, [0] * 64) == greedy.argmax(-1).tolist()
