"""Temperature sampling of a whole logits matrix in two Triton launches (the Gumbel-max race).

A row with temperature ``t > 0`` takes ``argmax(z / t + G)``, ``G = -log E`` a standard Gumbel
draw per vocabulary entry (``E ~ Exp(1)``): the token of the exponential race ``argmax(p / E)`` of
``duetserve.engine.sampler``, which picks token ``i`` with probability ``softmax(z / t)_i``
(Gumbel 1954; the "Gumbel-max trick", e.g. Maddison et al. 2014). ``E = -log(1 - u)`` for a
uniform ``u``, computed from ``u``'s small end (a series below 0.01), so the smallest draws, which
decide the race, keep 31 bits of resolution. A row with ``t == 0`` takes ``argmax(z)``, the lowest
index among equal maxima, like ``torch.argmax``.

``U`` comes from Philox-4x32-10 (Salmon et al. 2011, Triton's ``tl.philox``) keyed by the row's
64-bit seed, with counter ``(column group, position low, position high, 0)``: a request's draw
depends only on its seed and the position of the token it samples, never on the batch around it,
the plan that ran it or how many look-ahead steps it was given. Each Philox call gives four
numbers, for four columns a quarter of a tile apart.

The torch path this replaces launched about ten kernels a step over the ``[n, vocab]`` float32
logits (select, scale, draw, log, subtract, two argmaxes, copy): at 128 rows about 0.37 ms a step on
the H200 (docs/benchmarks.md, twenty-first session). Here the first launch reads the logits once,
each program a tile of one row, and writes the tile's best (key, column); the second picks each
row's best tile.

On a machine without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set
before this module is imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # vocabulary entries a program (four quarters, one Philox call for four entries)


@triton.jit
def _best(key, col, best_key, best_col):
    """The better of two (key, column) candidates: the larger key, the earlier one on ties."""
    take = key > best_key
    return tl.where(take, key, best_key), tl.where(take, col, best_col)


@triton.jit
def _quarter(src, cols, vocab, t, r, best_key, best_col, RACE: tl.constexpr):
    """Fold the columns ``cols`` of one row into the best (key, column) so far; ``RACE``: the key is
    ``z / t`` plus the Gumbel draw made from the Philox outputs ``r``, else ``z``."""
    z = tl.load(src + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    if RACE:
        # E = -log(1 - u) ~ Exp(1), taken from u's small end, where u keeps its resolution: the smallest
        # E decide the race (as -log(U) of a U near 1, float32 would round them to steps of 6e-8 and
        # tie them). A u of 0 (odds 2^-31) counts as half a step.
        u = tl.maximum(tl.uint_to_uniform_float(r), 2.3283064e-10)
        e = tl.where(u < 0.01, u * (1.0 + u * (0.5 + u * (0.33333334 + u * 0.25))), -tl.log(1.0 - u))
        z = z / t - tl.log(e)
    key = tl.max(z, axis=0)
    return _best(key, tl.min(tl.where(z == key, cols, 2147483647), axis=0), best_key, best_col)


@triton.jit
def _race_tile_kernel(logits_ptr, temp_ptr, seed_ptr, pos_ptr, key_out, col_out, stride, vocab, tiles,
                      QUARTER: tl.constexpr):
    """Program (row, tile): the best key of ``4 * QUARTER`` columns of one row, and its column."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    offs = tl.arange(0, QUARTER)
    cols = tile * (4 * QUARTER) + offs
    src = logits_ptr + row * stride
    best_key = tl.full((), float("-inf"), tl.float32)
    best_col = tl.full((), 0, tl.int32)
    if t > 0:
        pos = tl.load(pos_ptr + row)
        group = (tile * QUARTER + offs).to(tl.uint32)
        zero = group * 0
        r0, r1, r2, r3 = tl.philox(tl.load(seed_ptr + row), group, zero + (pos & 0xFFFFFFFF).to(tl.uint32),
                                   zero + (pos >> 32).to(tl.uint32), zero)
        best_key, best_col = _quarter(src, cols, vocab, t, r0, best_key, best_col, True)
        best_key, best_col = _quarter(src, cols + QUARTER, vocab, t, r1, best_key, best_col, True)
        best_key, best_col = _quarter(src, cols + 2 * QUARTER, vocab, t, r2, best_key, best_col, True)
        best_key, best_col = _quarter(src, cols + 3 * QUARTER, vocab, t, r3, best_key, best_col, True)
    else:
        for q in tl.static_range(4):
            best_key, best_col = _quarter(src, cols + q * QUARTER, vocab, t, offs, best_key, best_col, False)
    tl.store(key_out + row * tiles + tile, best_key)
    tl.store(col_out + row * tiles + tile, best_col)


@triton.jit
def _race_row_kernel(key_ptr, col_ptr, out_ptr, tiles, BLOCK: tl.constexpr):
    """Program row: the column of the row's best tile key (the earliest tile on ties)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keys = tl.load(key_ptr + row * tiles + offs, mask=offs < tiles, other=float("-inf"))
    best = tl.min(tl.where((keys == tl.max(keys, axis=0)) & (offs < tiles), offs, BLOCK), axis=0)
    tl.store(out_ptr + row, tl.load(col_ptr + row * tiles + best).to(tl.int64))


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (module docstring).

    Args:
        logits: ``[n, vocab]`` float32 (or bf16/fp16), last dim contiguous.
        temperature: ``[n]`` float32; 0 takes the argmax.
        seeds: ``[n]`` int64 Philox keys, one per request.
        positions: ``[n]`` int64, the position of the token each row samples from (any value that
            differs between a request's sampled tokens).

    Returns:
        ``[n]`` int64 token ids, on the logits' device.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, or a logits row that is not contiguous.
    """
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("race_sample needs the logits' last dimension contiguous")
    for name, t, dtype in (("temperature", temperature, torch.float32), ("seeds", seeds, torch.int64),
                           ("positions", positions, torch.int64)):
        if t.shape != (n,) or t.dtype != dtype or t.device != logits.device:
            raise ValueError(f"race_sample: {name} must be [{n}] {dtype} on {logits.device}, "
                             f"got {list(t.shape)} {t.dtype} on {t.device}")
    tiles = triton.cdiv(vocab, TILE)
    keys = torch.empty(n, tiles, dtype=torch.float32, device=logits.device)
    cols = torch.empty(n, tiles, dtype=torch.int32, device=logits.device)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    _race_tile_kernel[(n, tiles)](logits, temperature, seeds, positions, keys, cols, logits.stride(0), vocab, tiles,
                                  QUARTER=TILE // 4, num_warps=8)
    _race_row_kernel[(n,)](keys, cols, out, tiles, BLOCK=max(16, triton.next_power_of_2(tiles)), num_warps=1)
    return out
