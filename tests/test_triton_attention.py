"""Triton paged attention kernels against ``TorchAttention`` and a float64 reference.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set for this
module's tests only) in float32, and fp16 for the 16-bit tiles, on small shapes; the ``gpu``
tests sweep many shapes in bf16 and replay a captured CUDA graph.
Cache slots that no sequence owns, and outputs before each run, hold NaN: an unwritten output
or a read past a sequence's context shows up as NaN.
"""
from __future__ import annotations

import itertools
import math
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from conftest import CUDA, import_triton_module

from duetserve.model.attention import AttentionMetadata, TorchAttention
from duetserve.model.backends import FlashAttnBackend, make_attention_backend

DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
FP32_TOL, BF16_TOL = 1e-3, 1e-2
HALF = torch.bfloat16 if CUDA else torch.float16  # Triton's interpreter gets bf16 dots wrong

ta = import_triton_module("duetserve.model.triton_attention")
pytestmark = pytest.mark.usefixtures("triton_interpreter")


@dataclass
class Batch:
    """A flattened batch over a paged cache whose unowned slots hold NaN."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_batch(qlens, ctxs, hq, hkv, head_dim, block_size, dtype=torch.float32, num_decodes=0, seed=0) -> Batch:
    """Sequences with ``qlens`` new tokens and ``ctxs`` tokens in all, blocks scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-c // block_size) for c in ctxs]
    num_blocks = sum(counts) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(counts)
    tables, slots = [], []
    k_cache = torch.full((num_blocks, block_size, hkv, head_dim), math.nan)
    v_cache = k_cache.clone()
    for n, ql, c in zip(counts, qlens, ctxs):
        blocks, perm = perm[:n], perm[n:]
        tables.append(blocks + [0] * (width - n))
        seq_slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(c)])
        for cache in (k_cache, v_cache):
            cache.view(-1, hkv, head_dim)[seq_slots] = torch.randn(c, hkv, head_dim, generator=gen)
        slots += seq_slots[c - ql:].tolist()
    starts = list(itertools.accumulate(qlens, initial=0))
    i32 = {"dtype": torch.int32, "device": DEVICE}
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), query_start_loc=torch.tensor(starts, **i32),
        context_lens=torch.tensor(ctxs, **i32), block_tables=torch.tensor(tables, **i32),
        num_decodes=num_decodes, query_lens_cpu=list(qlens), context_lens_cpu=list(ctxs))
    q = torch.randn(starts[-1], hq, head_dim, generator=gen)
    return Batch(*(t.to(DEVICE, dtype) for t in (q, k_cache, v_cache)), meta, head_dim ** -0.5)


def reference64(q, k_cache, v_cache, block_tables, qlens, ctxs, scale) -> torch.Tensor:
    """Causal attention in float64, each sequence's exact ``ctx`` keys gathered from its blocks."""
    block_size, hkv = k_cache.shape[1:3]
    outs, start = [], 0
    for table, ql, c in zip(block_tables.tolist(), qlens, ctxs):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)])
        keys, values = (cache.view(-1, hkv, cache.shape[-1])[slots.to(cache.device)].double()
                        .repeat_interleave(q.shape[1] // hkv, 1) for cache in (k_cache, v_cache))
        scores = torch.einsum("qhd,khd->hqk", q[start:start + ql].double(), keys) * scale
        future = torch.arange(c, device=q.device)[None, :] > torch.arange(c - ql, c, device=q.device)[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(future, -math.inf).softmax(-1), values))
        start += ql
    return torch.cat(outs)


def new_kv(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's own K/V ``[T, Hkv, D]``, read back from its cache slots."""
    hkv, d = b.k_cache.shape[2:]
    return tuple(c.view(-1, hkv, d)[b.meta.slot_mapping] for c in (b.k_cache, b.v_cache))


def torch_reference(b: Batch) -> torch.Tensor:
    """``TorchAttention`` on the batch, unowned cache slots made finite (it reads padding)."""
    k_cache, v_cache = (torch.where(c.isnan(), torch.randn_like(c), c) for c in (b.k_cache, b.v_cache))
    return TorchAttention().forward(b.q, *new_kv(b), k_cache, v_cache, b.meta, b.scale)


def assert_close(out: torch.Tensor, b: Batch, tol: float) -> None:
    """Every element finite; each sequence within ``tol`` relative error of both references."""
    assert out.isfinite().all(), "output not written everywhere (NaN left)"
    m = b.meta
    refs = [reference64(b.q, b.k_cache, b.v_cache, m.block_tables, m.query_lens_cpu, m.context_lens_cpu, b.scale),
            torch_reference(b).double()]
    bounds = list(itertools.accumulate(m.query_lens_cpu, initial=0))
    for ref in refs:
        for lo, hi in itertools.pairwise(bounds):
            err = ((out[lo:hi].double() - ref[lo:hi]).norm() / ref[lo:hi].norm()).item()
            assert err < tol, f"rows {lo}:{hi}: relative error {err:.2e}"


def run_decode(ctxs, hq, hkv, head_dim, block_size, dtype, num_splits, tol, counters=None) -> torch.Tensor:
    b = make_batch([1] * len(ctxs), ctxs, hq, hkv, head_dim, block_size, dtype, num_decodes=len(ctxs))
    out = torch.full_like(b.q, math.nan)
    m = b.meta
    ta.paged_decode_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.context_lens, b.scale, out=out,
                              num_splits=num_splits, counters=counters)
    assert_close(out, b, tol)
    return out


def run_prefill(qlens, ctxs, hq, hkv, head_dim, block_size, dtype, tol) -> None:
    b = make_batch(qlens, ctxs, hq, hkv, head_dim, block_size, dtype)
    out = torch.full_like(b.q, math.nan)
    m = b.meta
    ta.paged_prefill_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc, m.context_lens,
                               b.scale, out=out)
    assert_close(out, b, tol)


# hq, hkv, head_dim, block_size, context lengths, splits: GQA 1/2/4/8 and SmolLM2's 3, cache
# block and key tile edges (fp32 tiles hold 32 keys: 31, 32, 33), splits with empty parts.
DECODE_CASES = [
    (4, 4, 32, 16, [1, 16, 31, 32, 33, 70], 1),
    (4, 2, 64, 8, [9, 64, 65, 130], 2),
    (8, 2, 128, 32, [33, 200], 4),
    (8, 1, 32, 16, [100, 3, 64], 8),
    (9, 3, 64, 16, [50, 129], None),
    (4, 2, 80, 16, [20, 90], 2),  # a head size that is not a power of two
]


@pytest.mark.parametrize("hq,hkv,head_dim,block_size,ctxs,splits", DECODE_CASES)
def test_decode_fp32(hq, hkv, head_dim, block_size, ctxs, splits):
    run_decode(ctxs, hq, hkv, head_dim, block_size, torch.float32, splits, FP32_TOL)


def test_decode_in_a_wide_block_table(monkeypatch):
    """``MAX_SPLITS`` splits over contexts of 1 to 3 key tiles in a block table 40x wider (as in a
    CUDA graph): the spare split slots exit unwritten; the merge reads only the splits that ran
    (its partial buffers start as NaN here, so reading an unwritten one shows up as NaN)."""
    b = make_batch([1] * 4, [1, 5, 40, 70], 8, 2, 64, 16, num_decodes=4)
    m = b.meta
    tables = torch.zeros(4, 40 * m.block_tables.shape[1], dtype=torch.int32, device=DEVICE)
    tables[:, :m.block_tables.shape[1]] = m.block_tables
    out = torch.full_like(b.q, math.nan)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(math.nan))
    ta.paged_decode_attention(b.q, b.k_cache, b.v_cache, tables, m.context_lens, b.scale, out=out,
                              num_splits=ta.MAX_SPLITS)
    monkeypatch.undo()
    assert_close(out, b, FP32_TOL)


@pytest.mark.parametrize("ctxs,num_splits,partial_slots", [
    # 38 tiles / (4 * 1) -> 10 a split: the 32-tile context gets 4 splits, the others 1
    ([3, 40, 1000, 70], 1, [2, 3, 4, 5]),
    ([3, 40, 1000, 70], 2, [2, 3, 4, 5, 6, 7, 8]),  # 38 / 8 -> 5 a split: 7 splits
    # 23 one-tile contexts and one of 200 tiles: 223 / 24 -> 10 a split, 20 splits for the long one
    # (slots 7-26), merged in two chunks of _MERGE_MIN_CHUNK (16), the second part-empty
    ([20] * 7 + [6400] + [20] * 16, 1, list(range(7, 27))),
])
def test_decode_balances_splits_over_uneven_contexts(monkeypatch, ctxs, num_splits, partial_slots):
    """Every split holds ``cdiv(tiles, nd * num_splits)`` key tiles (fp32 tiles hold 32 keys), so a
    long context gets more splits than ``num_splits`` and short ones one, which writes the output
    itself. The partial records (NaN until written) show which split slots, of ``nd * (num_splits
    + 1)``, ran beside others of their sequence."""
    b = make_batch([1] * len(ctxs), ctxs, 8, 2, 64, 16, num_decodes=len(ctxs))
    m = b.meta
    out = torch.full_like(b.q, math.nan)
    buffers, empty = [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: buffers.append(empty(*a, **kw).fill_(math.nan)) or buffers[-1])
    ta.paged_decode_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.context_lens, b.scale, out=out,
                              num_splits=num_splits)
    monkeypatch.undo()
    assert_close(out, b, FP32_TOL)
    part = buffers[0]
    assert part.shape == (len(ctxs) * (num_splits + 1), 8, 64)
    assert part.isfinite().all(2).all(1).nonzero().flatten().tolist() == partial_slots


@pytest.mark.parametrize("num_splits, num_warps, group_p2, block_d, chunk", [
    (1, 2, 4, 128, 16),  # Qwen3-8B at batch 33+: 16 x 4 x 128 = 8192 floats, 128 a thread
    (8, 2, 8, 128, 8),  # GQA group 8: 16 would be 256 floats a thread (spilled on the H200)
    (8, 2, 4, 256, 8),  # head dim 256 likewise
    (32, 4, 4, 128, 32),  # batch 1: 32 splits in one step at 4 warps
    (32, 4, 8, 128, 16),
    (4, 2, 1, 64, 16),  # small heads: the floor of 16, whatever num_splits
    (1, 2, 64, 1024, 1),  # nothing fits: one split a step
])
def test_merge_chunk(num_splits, num_warps, group_p2, block_d, chunk):
    """Splits merged a step: at least 16 (or ``num_splits``), at most 16384 floats at 4 warps and
    8192 at 2."""
    assert ta.merge_chunk(num_splits, num_warps, group_p2, block_d) == chunk


@pytest.mark.parametrize("merge_elements", [None, 256])
def test_decode_counters_reset_and_reused(monkeypatch, merge_elements):
    """The last split of each (sequence, KV head) merges and sets its counter back to 0: two calls
    on one counters buffer (larger than needed) give the output of fresh counters, the reference's,
    and leave every counter at 0. Contexts of 1 to 5 key tiles (16-bit tiles hold 64 keys): one
    split runs for some sequences (no counter), two to five for the others. The merge takes all
    splits in one step, or (256 elements: 2 splits of 4 heads of 32) in several."""
    if merge_elements:
        monkeypatch.setattr(ta, "_MERGE_ELEMENTS", merge_elements)
    ctxs, hkv = [3, 70, 300, 64, 200], 2
    counters = torch.zeros(len(ctxs) * hkv + 3, dtype=torch.int32, device=DEVICE)
    for splits in (4, 8):
        outs = [run_decode(ctxs, 8, hkv, 32, 16, HALF, splits, BF16_TOL, c) for c in (counters, counters, None)]
        assert not counters.any()
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("num_seqs,max_context,splits", [
    (1, 40960, 32),  # 2 * 132 / 8 = 33 programs wanted per sequence: 64, capped at MAX_SPLITS
    (2, 40960, 32),  # 17 -> 32
    (4, 40960, 16),  # 9 -> 16
    (8, 40960, 8),  # 5 -> 8
    (16, 40960, 4),  # 3 -> 4
    (32, 40960, 2),  # 264 / 256 -> 2
    (33, 40960, 1),  # 264 / 264 = 1
    (128, 40960, 1),
    (1, 512, 8),  # an exact block table: 512 keys hold 8 splits of 64
    (1, 100, 2),  # 2 splits of 64 keys
    (1, 16, 1),
])
def test_default_num_splits(num_seqs, max_context, splits):
    """Qwen3-8B's 8 KV heads on an H200's 132 SMs; ``max_context`` is the block table's capacity."""
    assert ta.default_num_splits(num_seqs, 8, max_context, 132) == splits


def test_decode_variants_hand_counted():
    """Qwen3-8B's 8 KV heads on 132 SMs, 64 sequences, a 40960-token table: up to 16 sequences
    (``BLOCK_SEQS`` 16) take 1-32 splits, 17-32 take 1-2 (17 want 264 / 136 -> 2), 33-64 take 1."""
    assert ta.decode_variants(64, 8, 40960, 132) == [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (1, 32),
                                                     (17, 1), (17, 2), (33, 1)]
    with pytest.raises(ValueError, match="max_seqs=0"):
        ta.decode_variants(0, 8, 40960, 132)


@pytest.mark.parametrize("max_seqs,hkv,sms", [(64, 8, 132), (40, 2, 16), (130, 4, 132), (5, 8, 132)])
def test_decode_variants_cover_every_default_launch(max_seqs, hkv, sms):
    """Every (``BLOCK_SEQS``, ``num_splits``) a default decode launch takes, for 1 to ``max_seqs``
    sequences and block tables of 1-200 blocks of 16 tokens, is one the warm-up compiles, and the
    warm-up compiles no other."""
    def key(n: int, splits: int) -> tuple[int, int]:
        return max(16, 1 << (n - 1).bit_length()), splits

    launched = {key(n, ta.default_num_splits(n, hkv, w * 16, sms)) for n in range(1, max_seqs + 1)
                for w in range(1, 201)}
    assert {key(n, s) for n, s in ta.decode_variants(max_seqs, hkv, 200 * 16, sms)} == launched


# hq, hkv, head_dim, block_size, query lengths, context lengths: a whole prompt, a chunk after
# a cached prefix, chunks starting either side of a key tile edge (positions 30..33), several
# sequences (one of a single token), query tiles crossed (fp32 tiles hold 64 rows: 8 tokens
# with GQA 8, 21 with GQA 3, 64 with GQA 1).
PREFILL_CASES = [
    (4, 4, 32, 16, [70], [70]),
    (4, 2, 64, 8, [30], [100]),
    (4, 2, 32, 16, [5, 5, 5, 5], [35, 36, 37, 38]),
    (8, 2, 128, 32, [1, 17, 40, 5], [1, 50, 40, 90]),
    (8, 1, 32, 16, [20, 33], [20, 80]),
    (9, 3, 64, 16, [45, 7], [60, 7]),
    (2, 2, 32, 16, [150], [170]),
    (4, 2, 80, 16, [30], [90]),
]


@pytest.mark.parametrize("hq,hkv,head_dim,block_size,qlens,ctxs", PREFILL_CASES)
def test_prefill_fp32(hq, hkv, head_dim, block_size, qlens, ctxs):
    run_prefill(qlens, ctxs, hq, hkv, head_dim, block_size, torch.float32, FP32_TOL)


def test_half_precision_tiles():
    """The 16-bit tiles (those bf16 uses on the GPU) in fp16: Triton's interpreter gets bf16 dots wrong."""
    run_decode([1, 63, 64, 65, 200], 8, 2, 64, 16, torch.float16, None, BF16_TOL)
    run_prefill([3, 70, 40], [3, 130, 64], 8, 2, 64, 16, torch.float16, BF16_TOL)
    # GQA group 3: 85 tokens a 256-row tile (one row spare), chunks crossing one and two tiles
    run_prefill([3, 90, 173], [3, 150, 173], 6, 2, 64, 16, torch.float16, BF16_TOL)


@pytest.mark.parametrize("dtype,splits,tiles", [
    (torch.float16, 1, (64, 2)), (torch.float16, 8, (64, 2)), (torch.float16, 16, (64, 4)),
    (torch.float16, 32, (64, 4)), (torch.float32, 2, (32, 4)), (torch.float32, 32, (32, 4))])
def test_decode_warps_follow_the_split_count(monkeypatch, dtype, splits, tiles):
    """16-bit decode runs 2 warps up to ``_NARROW_SPLITS`` splits and 4 above (the last split merges
    every split's partials); fp32 keeps 32-key tiles and 4 warps."""
    b = make_batch([1] * 2, [40, 70], 8, 2, 64, 16, num_decodes=2, dtype=dtype)
    seen = []
    monkeypatch.setattr(ta, "_launch", lambda *a, **kw: seen.append((a[10], a[13], a[11])))
    ta.paged_decode_attention(b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, b.scale,
                              num_splits=splits)
    assert seen == [(*tiles, splits)]


def test_backend_mixed_batch_equals_torch():
    """Two decodes then two prefill chunks through ``forward``: same output and cache as ``TorchAttention``;
    with K/V None, the same output again and the cache untouched."""
    b = make_batch([1, 1, 10, 25], [5, 40, 10, 60], 8, 2, 64, 16, num_decodes=2)
    finite = [torch.where(c.isnan(), torch.randn_like(c), c) for c in (b.k_cache, b.v_cache)]
    caches = {name: [c.clone() for c in finite] for name in ("torch", "triton")}
    k, v = (torch.randn_like(x) for x in new_kv(b))  # new K/V differ from the cache: forward must write them
    out = {name: backend.forward(b.q, k, v, *caches[name], b.meta, b.scale)
           for name, backend in (("torch", TorchAttention()), ("triton", ta.TritonAttention()))}
    assert out["triton"].isfinite().all()
    err = ((out["triton"] - out["torch"]).norm() / out["torch"].norm()).item()
    assert err < FP32_TOL
    assert all(torch.equal(a, b) for a, b in zip(caches["torch"], caches["triton"], strict=True))
    written = [c.clone() for c in caches["triton"]]  # K/V None: already in the cache (the decoder's fused RoPE)
    for name, backend in (("torch", TorchAttention()), ("triton", ta.TritonAttention())):
        assert torch.equal(backend.forward(b.q, None, None, *caches[name], b.meta, b.scale), out[name])
        assert all(torch.equal(a, b) for a, b in zip(caches[name], written, strict=True))


def test_argument_errors():
    b = make_batch([1], [5], 4, 2, 32, 16, num_decodes=1)
    m = b.meta
    with pytest.raises(ValueError, match="num_splits"):
        ta.paged_decode_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.context_lens, b.scale, num_splits=3)
    with pytest.raises(ValueError, match="dtype"):
        ta.paged_decode_attention(b.q.double(), b.k_cache, b.v_cache, m.block_tables, m.context_lens, b.scale)
    with pytest.raises(ValueError, match="query heads"):
        ta.paged_decode_attention(b.q[:, :3], b.k_cache, b.v_cache, m.block_tables, m.context_lens, b.scale)
    # nd * Hkv = 2 counters: too few, int64, on another device, not 1-D
    for bad in (torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE),
                torch.zeros(2, dtype=torch.int32, device="meta"), torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match="counters must be"):
            ta.paged_decode_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.context_lens, b.scale,
                                      num_splits=2, counters=bad)
    with pytest.raises(ValueError, match="query_start_loc"):
        ta.paged_prefill_attention(b.q, b.k_cache, b.v_cache, m.block_tables, m.query_start_loc[:1],
                                   m.context_lens, b.scale)
    # a context or block-table row without its query would get splits (and counters) of its own
    for tables, lens in ((m.block_tables, m.context_lens.repeat(2)), (m.block_tables.repeat(2, 1), m.context_lens)):
        with pytest.raises(ValueError, match=r"a row per query \(1\); got"):
            ta.paged_decode_attention(b.q, b.k_cache, b.v_cache, tables, lens, b.scale)
    many = torch.zeros(1986, 4, 32)  # 1986 x (32 + 1) = 65538 split slots: over CUDA's grid limit (shapes only)
    with pytest.raises(ValueError, match="65538 split slots, over CUDA's 65535"):
        ta.paged_decode_attention(many, b.k_cache.float(), b.v_cache.float(), m.block_tables, m.context_lens, b.scale,
                                  num_splits=32)


def test_selector(monkeypatch):
    assert isinstance(make_attention_backend("torch", "cpu"), TorchAttention)
    assert isinstance(make_attention_backend("auto", "cpu"), TorchAttention)
    assert isinstance(make_attention_backend("triton", DEVICE), ta.TritonAttention)
    with pytest.raises(ValueError, match="must be one of"):
        make_attention_backend("xformers", "cpu")
    with pytest.raises(ValueError, match="^--attention-backend flash needs a CUDA device$"):  # no Triton hint
        make_attention_backend("flash", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="^--attention-backend triton needs a CUDA device .it also runs on the CPU"):
        make_attention_backend("triton", "cpu")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails
    with pytest.raises(ValueError, match="does not import"):
        FlashAttnBackend(256)
    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttnBackend(16)


def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                causal, block_table):
    """flash-attn's documented semantics for a paged cache, on the float64 reference."""
    qlens, ctxs = (x.diff().tolist() for x in (cu_seqlens_q, cu_seqlens_k))
    assert causal and max_seqlen_q == max(qlens) and max_seqlen_k == max(ctxs)
    return reference64(q, k, v, block_table, qlens, ctxs, softmax_scale).to(q.dtype)


def test_flash_backend_arguments(monkeypatch):
    """The flash backend's call (cumulative key lengths, block table, max lengths) matches ``TorchAttention``."""
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fake_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    b = make_batch([1, 12, 300], [40, 12, 700], 4, 2, 32, 256, num_decodes=1)
    out = FlashAttnBackend(256).forward(b.q, *new_kv(b), b.k_cache, b.v_cache, b.meta, b.scale)
    assert_close(out, b, FP32_TOL)


def test_engine_greedy_triton_equals_torch(tiny_qwen3_folder):
    """Chunked prefill, mixed batches and decodes of the tiny Qwen3 (GQA 2, head_dim 32, block 8)."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine
    from duetserve.sampling import SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 17, 45)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), device=str(DEVICE), dtype="float32",
                                        max_num_batched_tokens=32, num_kv_blocks=64, block_size=8,
                                        attention_backend=backend))
        tokens[backend] = engine.generate(prompts, params)
    assert tokens["triton"] == tokens["torch"]


# --- GPU: bf16 over many shapes ------------------------------------------------------------------

# hq, hkv, head_dim (Qwen3-8B, MHA, GQA 2, SmolLM2, GQA 8 wide, the tiny test model) x block sizes.
GPU_SHAPES = [(*heads, block_size) for heads in [(32, 8, 128), (32, 32, 128), (16, 8, 64), (9, 3, 64),
                                                 (64, 8, 128), (4, 2, 32)] for block_size in (8, 16, 32)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", GPU_SHAPES)
def test_decode_gpu(hq, hkv, head_dim, block_size):
    gen = torch.Generator().manual_seed(hq * block_size)
    counters = torch.zeros(129 * hkv, dtype=torch.int32, device=DEVICE)  # shared: each call leaves it at 0
    for num_seqs, splits in ((1, None), (33, None), (7, 1), (3, ta.MAX_SPLITS)):
        ctxs = torch.randint(1, 3000, (num_seqs,), generator=gen).tolist()
        run_decode(ctxs, hq, hkv, head_dim, block_size, torch.bfloat16, splits, BF16_TOL, counters)
    run_decode(list(range(1, 130)), hq, hkv, head_dim, block_size, torch.bfloat16, 2, BF16_TOL,  # every tile edge
               counters)
    # one long context among short ones: split in more than MAX_SPLITS programs, merged in several chunks
    run_decode([20000] + [50] * 40, hq, hkv, head_dim, block_size, torch.bfloat16, None, BF16_TOL, counters)
    assert not counters.any()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", GPU_SHAPES)
def test_prefill_gpu(hq, hkv, head_dim, block_size):
    run_prefill([2048], [2048], hq, hkv, head_dim, block_size, torch.bfloat16, BF16_TOL)
    # 20-token chunks after prefixes of 100..229 tokens: every offset against a 128-key span.
    run_prefill([20] * 130, list(range(120, 250)), hq, hkv, head_dim, block_size, torch.bfloat16, BF16_TOL)
    run_prefill([1, 300, 77, 512], [1000, 300, 2000, 1500], hq, hkv, head_dim, block_size, torch.bfloat16,
                BF16_TOL)


@pytest.mark.gpu
@needs_cuda
def test_decode_cuda_graph_replay():
    """Recorded once, replayed over other context lengths, block tables and caches: still exact;
    the split counters (in no memset node) are zero after every replay."""
    shape = {"hq": 32, "hkv": 8, "head_dim": 128, "block_size": 16, "dtype": torch.bfloat16, "num_decodes": 8}
    static = make_batch([1] * 8, [4000] * 8, **shape)
    q, k_cache, v_cache = static.q, static.k_cache, static.v_cache
    tables, ctxs = static.meta.block_tables.clone(), static.meta.context_lens.clone()
    out = torch.empty_like(q)
    counters = torch.zeros(8 * shape["hkv"], dtype=torch.int32, device=DEVICE)

    def step():
        ta.paged_decode_attention(q, k_cache, v_cache, tables, ctxs, static.scale, out=out, counters=counters)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2):
        lens = torch.randint(1, 4000, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
        b = make_batch([1] * 8, lens, seed=seed, **shape)
        q.copy_(b.q)
        k_cache[:b.k_cache.shape[0]].copy_(b.k_cache)
        v_cache[:b.v_cache.shape[0]].copy_(b.v_cache)
        tables.zero_()[:, :b.meta.block_tables.shape[1]].copy_(b.meta.block_tables)
        ctxs.copy_(b.meta.context_lens)
        out.fill_(math.nan)
        graph.replay()
        assert_close(out, b, BF16_TOL)
        assert not counters.any()


@pytest.mark.gpu
@needs_cuda
def test_attention_compiles_once_across_batch_shapes():
    """The number of sequences and the block-table width change with every batch; neither may
    make Triton compile a new variant (each compile stalls serving for about a second)."""
    kernel = ta._paged_attention_kernel

    def variants() -> int:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    run_prefill([5], [20], 8, 2, 64, 16, torch.bfloat16, BF16_TOL)
    compiled = variants()
    for n in range(2, 8):
        qlens = [3 + i for i in range(n)]
        run_prefill(qlens, [q + 17 * i for i, q in enumerate(qlens)], 8, 2, 64, 16, torch.bfloat16, BF16_TOL)
    assert variants() == compiled
