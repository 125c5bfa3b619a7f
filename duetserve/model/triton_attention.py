"""Triton attention over the paged KV cache: decode (flash-decoding) and varlen causal prefill.

One kernel serves both. A program owns one KV head and a tile of query rows; the rows are
(token, query head) pairs of that KV head's group, so grouped-query attention reads each KV
tile once for all the heads that share it. Keys are walked in tiles of ``BLOCK_N`` cache
positions, each position's slot looked up in the block table, with the online softmax of
FlashAttention-2 (Dao 2023, arXiv:2307.08691): running row maximum and sum, rescaled
accumulator, ``exp2`` with the scale folded into ``log2(e)``. Tiles entirely below the causal
diagonal skip the mask.

Decode programs split the keys of each sequence across programs (flash-decoding, Dao et al.
2023, "Flash-Decoding for long-context inference"), balanced over the batch: ``num_splits`` is
the mean number of splits a sequence gets, and every split holds ``per_split = cdiv(tiles,
num_seqs * num_splits)`` key tiles (``tiles`` summed over the batch), so a sequence of ``t``
tiles gets ``cdiv(t, per_split)`` splits. With equal contexts that is at most ``num_splits`` each;
with uneven ones a long context gets more and a short one fewer, so no program walks a long
context alone while the others have finished. (With the same split count for every sequence,
served Mooncake decode batches of 13-31 sequences, one of 33k tokens, took 1.6-2.3x the time of
the bytes at the copy rate; balanced, 1.02-1.21x: docs/benchmarks.md, seventeenth session.) The
splits of all sequences, in order, fill the grid's second axis: ``num_seqs * (num_splits + 1)``
slots hold them, since ``sum(cdiv(t_i, per_split)) < sum(t_i) / per_split + num_seqs``; each
program finds its (sequence, split) from a prefix sum of the split counts, and the slots past
the last split exit at once. The KV head is the first axis, so programs dispatched together
read the same tokens' heads, which are adjacent in the cache (with the slot first, batches of
8-64 equal contexts ran 1.17-1.45x slower). Every loop bound is read from
``context_lens`` inside the kernel and every grid depends only on tensor shapes, so both entry
points can be captured in a CUDA graph. A lone split writes the output itself. Else each writes
a float32 partial output and its log-sum-exp, then counts itself on an int32 counter of its
(sequence, KV head) (an acquire-release atomic after a block barrier, the split-K "last block
reduces" pattern); the one that counts last merges the splits' partials for the group's query
heads, always in the same order (the result does not depend on which split finished last), and
sets the counter back to 0. No merge kernel is launched, and the counters, zero before and
after every call, need no memset (in a CUDA graph: no memset node per layer).

On sm_90 decode attention is launched with programmatic dependent launch (unless
``DUETSERVE_DECODE_GEMM=cublas`` asks for plain launches). In the decode graphs, where the fused
ops before it launch so too, its programs start while the RoPE and KV-write kernel still runs,
find their split from ``context_lens`` (written before the graph's first kernel), and wait
(``griddepcontrol.wait``) before they read the query, the cache or the counters, or write
anything. It never signals its own dependents early, so the next kernel starts as before.
Measured on the H200 (docs/benchmarks.md, twenty-second session), side by side: 3-94 us faster an
8-step decode step at every shape of the issue grid. Eager steps launch the same variant (the
kernel before theirs lets nothing start early, so the wait returns at once): one compile serves
both, and ``TritonAttention.compile_decode_variants`` compiles every variant before serving.
Signalling the dependents right after the wait, or loading a split's first cached keys before
it, was slower or no faster (twenty-third session).

On a machine without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``
set before this module is imported).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from duetserve.model.attention import AttentionMetadata, write_kv
from duetserve.model.layers import decode_gemm_mode
from duetserve.model.triton_gemm import pdl_supported

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32
# Tiles by element size (bf16/fp16, fp32), sized for Hopper's 227 KiB of shared memory and 255
# registers a thread: decode (keys per tile, warps); prefill (query rows, keys, warps) per program.
# Decode with 2 warps, not 4, at up to _NARROW_SPLITS splits (ninth H200 session, kernel alone
# in CUDA graphs, Qwen3-8B heads, bf16): 0.6-2.7 us faster a call at batch 8-128 (8 splits or
# fewer; 32 x 2048 67.7 against 69.6 us); at batch 1 (32 splits) 2.4-3.3 us slower, as the
# last split's merge of every split's partials has half the threads. Tiles of 32 or 128 keys and
# 8 warps were slower on the sum of the 8/32 x 512/2048 and 64 x 512 shapes.
_DECODE_TILES = {2: (64, 2), 4: (32, 4)}
_NARROW_SPLITS = 8
# Prefill: 256 query rows (64 tokens of 4 heads) a program, not 128 (eighteenth H200 session,
# kernel alone, bf16): 1.10-1.16x the TFLOP/s on 1 x 8192 (375 against 340), 8 x 1024, 2048 after
# 6144, 1 x 32768 (437 against 376) and 4 x 4096 after 4096. 128 rows by 128 keys was as fast
# (1.13x); 2 or 4 stages the same; 64 x 64 tiles, 4 warps, or the last query tiles launched first, slower.
_PREFILL_TILES = {2: (256, 64, 8), 4: (64, 32, 4)}
# Partial-output elements the decode merge loads a step with 4 warps (half that with 2): 16384
# (32 splits of 4 heads of 128 in one step) beat 4096 and 8192 on the H200, by up to 1.5 us at
# batch 1 (32 splits), no worse elsewhere. At 2 warps 16384 spills (GQA group 8 x head dim 128:
# 8 x 512 took 1.28x the time of 8192, nineteenth H200 session).
_MERGE_ELEMENTS = 16384
# Fewest splits the merge loads a step, whatever ``num_splits``: a long context among short ones
# gets many more splits than the mean (e.g. 72 with ``num_splits`` 1 at 1 x 40960 + 127 x 256),
# and the last split merges them one chunk after another. 16, not 8 (nineteenth H200 session,
# side by side, timed at GQA group 4 x head dim 128 only): one 40960-token context among 7-127
# short ones 0.94-0.99x the time, equal contexts the same (0.99-1.00x); 32 was slower (a 2-warp
# merge of 32 x 4 x 128 floats spills). ``_MERGE_ELEMENTS`` caps it for wider groups and heads.
# Skipping the merge altogether (wrong output) would save 4-12 us there; a two-level merge
# (groups of 8 splits) was as fast at 8 sequences and slower at 64-128.
_MERGE_MIN_CHUNK = 16
# CUDA's limit on a grid's second axis, the decode split slots
_MAX_GRID_Y = 65535


@triton.jit
def _attend_tiles(q, m_i, l_i, acc, k_cache, v_cache, table_row, head_off, stride_kb, stride_ks, row_pos, ctx,
                  qk_scale, lo, hi, offs_d, d_ok, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Online-softmax update of ``(m_i, l_i, acc)`` over key tiles ``lo..hi-1`` (log2 domain)."""
    offs_n = tl.arange(0, BLOCK_N)
    for t in range(lo, hi):
        pos = t * BLOCK_N + offs_n
        in_ctx = pos < ctx
        page = tl.load(table_row + pos // PAGE, mask=in_ctx, other=0).to(tl.int64)
        slot = page * stride_kb + (pos % PAGE) * stride_ks + head_off
        kv_mask = in_ctx[:, None] & d_ok[None, :]
        k = tl.load(k_cache + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASK:
            s = tl.where(pos[None, :] <= row_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _find_seq(query_start_loc, first, num_seqs, slot, BLOCK_Q: tl.constexpr):
    """Sequence owning tile slot ``slot``: sequence i's slots start at ``(start_i - first) // BLOCK_Q + i``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if (tl.load(query_start_loc + mid) - first) // BLOCK_Q + mid <= slot:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _merge_if_last(out, lse, part_ptr, lse_ptr, out_ptr, counter, tok, head0, hq, start, split, active, row_ok,
                   head, offs_d, d_ok, stride_ot, stride_oh, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                   HEAD_DIM: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """Store a decode split's partial ``out`` and ``lse`` (row r, of query head ``head[r]``, at
    record ``(start + split) * hq + head[r]``); the last of the ``active`` splits of the (token, KV
    head) to count itself on ``counter`` merges the partials of the group's heads ``head0 ..``,
    records ``start .. start + active - 1``, into ``out_ptr``: weights ``exp2(lse_s - max lse)``,
    ``MERGE_CHUNK`` splits of all heads a step. It then resets ``counter`` to 0."""
    rec = (start + split) * hq + head
    tl.store(part_ptr + rec[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + rec, lse, mask=row_ok)
    tl.debug_barrier()  # every thread's stores precede the release below (one thread does the atomic)
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
        tl.debug_barrier()  # the acquire (one thread) precedes every thread's loads
        heads = tl.arange(0, GROUP_P2)
        h_ok = heads < GROUP
        chunk = tl.arange(0, MERGE_CHUNK)
        top = tl.full([GROUP_P2], float("-inf"), tl.float32)
        for c in range(0, active, MERGE_CHUNK):
            s = c + chunk
            recs = (start + s)[None, :] * hq + (head0 + heads)[:, None]
            ok = h_ok[:, None] & (s < active)[None, :]
            top = tl.maximum(top, tl.max(tl.load(lse_ptr + recs, mask=ok, other=float("-inf")), 1))
        top = tl.where(h_ok, top, 0.0)  # padding heads: no NaN
        num = tl.zeros([GROUP_P2, offs_d.shape[0]], tl.float32)
        den = tl.zeros([GROUP_P2], tl.float32)
        for c in range(0, active, MERGE_CHUNK):
            s = c + chunk
            recs = (start + s)[None, :] * hq + (head0 + heads)[:, None]
            ok = h_ok[:, None] & (s < active)[None, :]
            w = tl.exp2(tl.load(lse_ptr + recs, mask=ok, other=float("-inf")) - top[:, None])
            part = tl.load(part_ptr + recs[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                           mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
            num += tl.sum(part * w[:, :, None], 1)
            den += tl.sum(w, 1)
        merged = num / tl.where(h_ok, den, 1.0)[:, None]
        tl.store(out_ptr + tok * stride_ot + (head0 + heads)[:, None] * stride_oh + offs_d[None, :],
                 merged.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # the next launch sees it (kernel boundary)


@triton.jit
def _find_split(context_lens, num_seqs, slot, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_SEQS: tl.constexpr):
    """Decode slot ``slot``'s ``(sequence, its context, its first split's slot, split, the
    sequence's split count, key tiles a split)``; sequence ``num_seqs`` past the last split. See
    the module docstring."""
    offs = tl.arange(0, BLOCK_SEQS)
    ctxs = tl.load(context_lens + offs, mask=offs < num_seqs, other=0)
    tiles = tl.cdiv(ctxs, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tl.sum(tiles), num_seqs * NUM_SPLITS), 1)
    counts = tl.cdiv(tiles, per_split)
    ends = tl.cumsum(counts, 0)
    seq = tl.sum((ends <= slot).to(tl.int32))
    mine = offs == seq
    start = tl.sum(tl.where(mine, ends - counts, 0))
    return seq, tl.sum(tl.where(mine, ctxs, 0)), start, slot - start, tl.sum(tl.where(mine, counts, 0)), per_split


# num_seqs and the block-table width change with every batch: no value specialisation (a
# recompile per new combination stalled serving for ~1 s each time).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
        q_ptr, k_cache, v_cache, out_ptr, part_ptr, lse_ptr, counters, block_tables, context_lens, query_start_loc,
        num_seqs, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, DECODE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_CHUNK: tl.constexpr, BLOCK_SEQS: tl.constexpr,
        PDL: tl.constexpr):
    """Grid ``(KV head, decode split slot)`` (DECODE) or ``(query-tile slot, KV head)``; see the
    module docstring."""
    kv_head = tl.program_id(0 if DECODE else 1)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    split = 0
    start = 0
    active = 1
    per_split = 0
    if DECODE:
        seq, ctx, start, split, active, per_split = _find_split(context_lens, num_seqs, tl.program_id(1),
                                                                NUM_SPLITS, BLOCK_N, BLOCK_SEQS)
        if seq >= num_seqs:
            return
        q_start = seq
        q_len = 1
        j0 = 0
    else:
        slot_id = tl.program_id(0)
        first = tl.load(query_start_loc)
        seq = _find_seq(query_start_loc, first, num_seqs, slot_id, BLOCK_Q)
        q_start = tl.load(query_start_loc + seq)
        q_len = tl.load(query_start_loc + seq + 1) - q_start
        q_start -= first
        j0 = (slot_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q
        if j0 >= q_len:
            return
        ctx = tl.load(context_lens + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = j0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    row_pos = tl.minimum(ctx - q_len + tok, ctx - 1)
    first_pos = ctx - q_len + j0
    n_tiles = tl.cdiv(tl.minimum(first_pos + BLOCK_Q, ctx), BLOCK_N)
    n_full = (first_pos + 1) // BLOCK_N
    if not DECODE:
        per_split = n_tiles
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_tiles)

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = q_start + tok
    if PDL:
        gdc_wait()  # above: context lens and block tables only, uploaded before the graph's first kernel
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_kh
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, k_cache, v_cache, table_row, head_off, stride_kb, stride_ks,
                                  row_pos, ctx, qk_scale, lo, tl.minimum(hi, n_full), offs_d, d_ok,
                                  PAGE, BLOCK_N, False, DOT_PRECISION)
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, k_cache, v_cache, table_row, head_off, stride_kb, stride_ks,
                                  row_pos, ctx, qk_scale, tl.maximum(lo, n_full), hi, offs_d, d_ok,
                                  PAGE, BLOCK_N, True, DOT_PRECISION)

    out = acc / l_i[:, None]
    if DECODE:
        if active > 1:
            hq = tl.num_programs(0) * GROUP
            counter = counters + seq * tl.num_programs(0) + kv_head
            _merge_if_last(out, m_i + tl.log2(l_i), part_ptr, lse_ptr, out_ptr, counter, seq, kv_head * GROUP, hq,
                           start, split, active, row_ok, head, offs_d, d_ok, stride_ot, stride_oh, GROUP, GROUP_P2,
                           HEAD_DIM, MERGE_CHUNK)
            return
    o_rows = q_rows.to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Validate the common arguments; return ``out`` or a new ``[T, Hq, D]`` tensor."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dim() != 4 or q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"expected q [T, Hq, D] and caches [blocks, block_size, Hkv, D]; got {tuple(q.shape)} "
                         f"and {tuple(k_cache.shape)}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if q.dtype != k_cache.dtype or q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches must share a dtype and be contiguous in the head dimension")
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must have q's shape {tuple(q.shape)} and be contiguous in the head dimension")
    return out


def merge_chunk(num_splits: int, num_warps: int, group_p2: int, block_d: int) -> int:
    """Splits the decode merge loads a step: at least ``_MERGE_MIN_CHUNK`` (or ``num_splits``), at
    most ``_MERGE_ELEMENTS * num_warps / 4`` partial-output floats of ``group_p2`` heads of
    ``block_d`` (so a 2-warp merge holds at most 128 floats a thread); at least 1."""
    return max(1, min(max(num_splits, _MERGE_MIN_CHUNK), _MERGE_ELEMENTS * num_warps // 4 // (group_p2 * block_d)))


def _launch(q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc, scale: float, grid0: int,
            block_m: int, block_n: int, num_splits: int, decode: bool, num_warps: int,
            counters: torch.Tensor | None = None) -> torch.Tensor:
    hq, head_dim = q.shape[1:]
    hkv = k_cache.shape[2]
    part, lse = out, out  # unused in prefill, as the counters (context_lens stands in: the same int32 type)
    if decode:  # a record per (split slot, query head)
        part = torch.empty(grid0, hq, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(grid0, hq, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    group_p2 = triton.next_power_of_2(hq // hkv)
    # Eager decodes launch the graphs' variant too: one compile serves both (decode_variants).
    pdl = decode and pdl_supported(q) and decode_gemm_mode() == "triton"
    _paged_attention_kernel[(hkv, grid0) if decode else (grid0, hkv)](
        q, k_cache, v_cache, out, part, lse, context_lens if counters is None else counters, block_tables,
        context_lens, query_start_loc, context_lens.shape[0], scale * _LOG2E, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), GROUP=hq // hkv, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_N=block_n, PAGE=k_cache.shape[1], NUM_SPLITS=num_splits, DECODE=decode,
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32", GROUP_P2=group_p2,
        MERGE_CHUNK=merge_chunk(num_splits, num_warps, group_p2, block_d),
        BLOCK_SEQS=triton.next_power_of_2(max(16, context_lens.shape[0])) if decode else 16, PDL=pdl,
        num_warps=num_warps, launch_pdl=pdl)
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Mean key splits per decode sequence (``paged_decode_attention``'s ``num_splits``): the
    power of two at or above ``2 * num_sms / (num_seqs * num_kv_heads)`` (at least two programs
    per SM), at most ``MAX_SPLITS`` and at most ``next_power_of_2(cdiv(max_context, 64))`` (64
    keys a split of ``max_context``, the block table's capacity in tokens).

    Depends only on shapes, never on tensor values, so a captured CUDA graph stays valid. The
    kernel deals the batch's key tiles to ``num_seqs * splits`` splits of equal size (see the
    module docstring), so short contexts get fewer splits than this and long ones more.
    """
    want = triton.cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(want), triton.next_power_of_2(triton.cdiv(max_context, 64))))


def decode_variants(max_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> list[tuple[int, int]]:
    """``(num_seqs, num_splits)`` pairs whose ``paged_decode_attention`` calls, between them, compile
    every decode kernel variant its default ``num_splits`` launches for 1 to ``max_seqs`` sequences
    with block tables of up to ``max_context`` tokens (``k_cache.shape[0] * block_size`` covers all).

    A variant is fixed by ``num_splits`` (``MERGE_CHUNK`` and the warps follow from it) and by the
    sequence count rounded up to a power of two, at least 16 (``BLOCK_SEQS``). For ``n`` sequences
    ``default_num_splits`` gives at most ``default_num_splits(n, .., max_context, ..)``, and a block
    table of ``w`` blocks caps it at ``next_power_of_2(cdiv(w * block_size, 64))``, so every power of
    two up to that occurs in eager steps. Compiled on first use instead, each variant held a served
    iteration 1.0-1.9 s on the H200 (docs/benchmarks.md, twenty-third session).

    Raises:
        ValueError: a size below 1.
    """
    if min(max_seqs, num_kv_heads, max_context, num_sms) < 1:
        raise ValueError(f"sizes must be >= 1, got max_seqs={max_seqs}, num_kv_heads={num_kv_heads}, "
                         f"max_context={max_context}, num_sms={num_sms}")
    first: dict[tuple[int, int], tuple[int, int]] = {}
    for n in range(1, max_seqs + 1):
        block_seqs = triton.next_power_of_2(max(16, n))
        top = default_num_splits(n, num_kv_heads, max_context, num_sms)
        for splits in (1 << i for i in range(top.bit_length())):
            first.setdefault((block_seqs, splits), (n, splits))
    return sorted(first.values())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           counters: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged keys (flash-decoding).

    A sequence's keys are split in ``cdiv(its tiles, per_split)`` programs, ``per_split`` the
    batch's key tiles over ``nd * num_splits`` (module docstring). With more than one split, the
    last split of each (sequence, KV head) to finish merges the splits' partial outputs;
    ``counters`` tells it which one is last.

    Args:
        q: ``[nd, Hq, D]`` query of each sequence's last token (float32, float16 or bfloat16,
            contiguous in D); ``Hq`` a multiple of ``Hkv``.
        k_cache / v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype, the same strides; the
            sequence's keys, the newest included, already written (``write_kv``).
        block_tables: ``[nd, max_blocks]`` int32, cache blocks of each sequence, in order.
        context_lens: ``[nd]`` int32, keys of each sequence (>= 1); only read on the device.
        scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[nd, Hq, D]`` output (a view is fine); written and returned.
        num_splits: mean key splits per sequence, a power of two <= ``MAX_SPLITS``; None picks
            ``default_num_splits`` (shapes only) on CUDA, 1 elsewhere.
        counters: optional contiguous ``[>= nd * Hkv]`` int32 on q's device, one arrival counter
            per (sequence, KV head) at ``seq * Hkv + kv_head``. They must be zero before the call
            and are zero again after it, so one buffer serves every call (a CUDA graph needs no
            memset), but two calls that may run at the same time (on two streams) must not share
            one. None: zeros allocated for this call (one-off callers, tests).

    Returns:
        ``[nd, Hq, D]`` in q's dtype. No host synchronisation; CUDA-graph capturable (with a
        ``counters`` buffer given, no memset; the partial outputs are allocated, from the
        graph's pool when captured).

    Raises:
        ValueError: mismatched shapes, dtypes or strides, ``context_lens`` or ``block_tables``
            not of ``nd`` rows, a bad ``num_splits`` (or ``nd * (num_splits + 1)`` over CUDA's
            65535 grid rows), or ``counters`` not int32, not on q's device, not contiguous 1-D,
            or fewer than ``nd * Hkv``.
    """
    out = _check(q, k_cache, v_cache, out)
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], k_cache.shape[2], block_tables.shape[1] * k_cache.shape[1],
                                        _num_sms(q.device)) if q.is_cuda else 1
    if not 1 <= num_splits <= MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], got {num_splits}")
    slots = q.shape[0] * (num_splits + 1)
    if slots > _MAX_GRID_Y:
        raise ValueError(f"{q.shape[0]} sequences x ({num_splits} splits + 1) = {slots} split slots, over CUDA's "
                         f"{_MAX_GRID_Y} grid rows: pass fewer num_splits")
    if context_lens.shape[0] != q.shape[0] or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"context_lens and block_tables need a row per query ({q.shape[0]}); got "
                         f"{context_lens.shape[0]} and {block_tables.shape[0]}")
    need = q.shape[0] * k_cache.shape[2]
    if counters is None:
        counters = torch.zeros(need, dtype=torch.int32, device=q.device)
    elif counters.dtype != torch.int32 or counters.device != q.device or counters.dim() != 1 \
            or counters.stride(0) != 1 or counters.numel() < need:
        raise ValueError(f"counters must be a contiguous 1-D int32 tensor on {q.device} with at least nd * Hkv = "
                         f"{need} elements; got {counters.dtype} {tuple(counters.shape)} on {counters.device}")
    if q.shape[0] == 0:
        return out
    block_m = max(16, triton.next_power_of_2(q.shape[1] // k_cache.shape[2]))
    block_n, num_warps = _DECODE_TILES[q.element_size()]
    if num_splits > _NARROW_SPLITS:
        num_warps = 4
    return _launch(q, k_cache, v_cache, out, block_tables, context_lens, context_lens, scale, slots, block_m,
                   block_n, num_splits, True, num_warps, counters)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of variable-length query chunks over their paged keys (FlashAttention-2).

    Sequence ``i`` has queries at positions ``context_lens[i] - q_len_i .. context_lens[i] - 1``
    and attends to its keys ``0 ..`` its own position: the cached prefix and the chunk's own
    keys, all read from the cache (write them first with ``write_kv``).

    Args:
        q: ``[T, Hq, D]`` queries of all sequences, concatenated (dtype as in decode).
        k_cache / v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype, the same strides.
        block_tables: ``[B, max_blocks]`` int32.
        query_start_loc: ``[B + 1]`` int32, non-decreasing; sequence ``i``'s queries are rows
            ``query_start_loc[i] - query_start_loc[0]`` up to ``query_start_loc[i + 1] -
            query_start_loc[0]`` of q, so a slice of a larger batch's offsets can be passed.
        context_lens: ``[B]`` int32, cached + new tokens of each sequence (>= its query count).
        scale: softmax scale.
        out: optional ``[T, Hq, D]`` output.

    Returns:
        ``[T, Hq, D]`` in q's dtype. No host synchronisation: the grid comes from ``T`` and ``B``.

    Raises:
        ValueError: mismatched shapes, dtypes or strides.
    """
    out = _check(q, k_cache, v_cache, out)
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc needs {num_seqs + 1} entries, got {query_start_loc.shape[0]}")
    if q.shape[0] == 0:
        return out
    group = q.shape[1] // k_cache.shape[2]
    block_m, block_n, num_warps = _PREFILL_TILES[q.element_size()]
    if q.shape[2] > 128:  # the 256-row tile was timed at head dim 128 only; wider heads spill 2.3x more
        block_m = min(block_m, 128)
    block_m = max(block_m, triton.next_power_of_2(group))
    grid0 = q.shape[0] // (block_m // group) + num_seqs
    return _launch(q, k_cache, v_cache, out, block_tables, context_lens, query_start_loc, scale, grid0,
                   block_m, block_n, 1, False, num_warps)


class TritonAttention:
    """Attention backend on the Triton paged kernels; same interface as ``TorchAttention``.

    Decodes (the first ``meta.num_decodes`` tokens) go through ``paged_decode_attention``, the
    prefill chunks after them through ``paged_prefill_attention``. Needs a CUDA device, or
    ``TRITON_INTERPRET=1`` on the CPU (slow; for tests). Graph-safe: decode-only batches may be
    recorded in CUDA graphs (``duetserve.engine.cuda_graphs``).
    """

    cuda_graph_safe = True

    @staticmethod
    def compile_decode_variants(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block: int,
                                counters: torch.Tensor) -> None:
        """Compile every decode kernel variant eager steps can launch (``decode_variants``) now, one
        call each: ``num_heads`` query heads of zeros over one key in cache block ``block``, which is
        only read; ``counters`` (``[max_seqs * Hkv]`` int32, zero) bounds the sequence count and is
        zero again after. Nothing to compile off CUDA (the interpreter runs the source).

        Raises:
            ValueError: as ``paged_decode_attention``.
        """
        if not k_cache.is_cuda:
            return
        hkv, device = k_cache.shape[2], k_cache.device
        max_context = k_cache.shape[0] * k_cache.shape[1]
        for n, splits in decode_variants(counters.numel() // hkv, hkv, max_context, _num_sms(device)):
            q = torch.zeros(n, num_heads, k_cache.shape[3], dtype=k_cache.dtype, device=device)
            tables = torch.full((n, 1), block, dtype=torch.int32, device=device)
            lens = torch.ones(n, dtype=torch.int32, device=device)
            paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, num_splits=splits, counters=counters)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` (written first) or None (already in the cache);
        returns ``[T, Hq, D]`` in q's dtype (``out`` when given, shaped like q)."""
        if k is not None:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q) if out is None else out
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd], scale,
                                   out=out[:nd], counters=meta.split_counters)
        if q.shape[0] > nd:
            paged_prefill_attention(q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.query_start_loc[nd:],
                                    meta.context_lens[nd:], scale, out=out[nd:])
        return out

