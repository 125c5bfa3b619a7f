"""The Triton decode GEMM (``triton_gemm.decode_gemm``) against torch, and its dispatch (``layers.linear``).

Without CUDA the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set for this
module's tests only) on small shapes and tiles, in float16 and bfloat16: the interpreter's
``tl.dot`` multiplies bfloat16 bit patterns as integers (numpy has no bfloat16), so on a CPU the
``bf16_dot`` fixture upcasts its bfloat16 operands to float32 first, as the GPU's MMA does in
effect (products of bf16 values are exact in float32). Outputs are compared in float64 by relative
error against ``F.linear`` of the same rounded operands, and allocated outputs start as NaN, so an
element left unwritten shows up. The ``gpu`` tests use Qwen3-8B's shapes in bfloat16, check the
programmatic-dependent-launch path and replay a captured CUDA graph against cuBLAS.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import CUDA, import_triton_module

from duetserve.model import fused_ops, layers

DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = 1e-2

tg = import_triton_module("duetserve.model.triton_gemm")
pytestmark = pytest.mark.usefixtures("triton_interpreter", "bf16_dot")
SMALL = tg.GemmConfig(block_n=16, block_k=64, head_k=128, num_warps=4, num_stages=2)


@pytest.fixture
def bf16_dot(monkeypatch):
    """On a CPU: the interpreter's ``tl.dot`` on bfloat16 operands computes in float32 instead."""
    if CUDA:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder

    create_dot = InterpreterBuilder.create_dot

    def dot(self, a, b, *rest):
        a, b = (self.cast_impl(h, tl.float32) if h.dtype.scalar == tl.bfloat16 else h for h in (a, b))
        return create_dot(self, a, b, *rest)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", dot)


def nan_empty(monkeypatch):
    """Every float tensor ``torch.empty`` allocates from now on starts as NaN."""
    empty = torch.empty

    def alloc(*a, **kw):
        x = empty(*a, **kw)
        return x.fill_(math.nan) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", alloc)


def operands(m, n, k, dtype, bias: bool, swiglu: bool, seed=0):
    """``x`` ``[m, k or 2k]`` (rows ``pad`` apart, gaps NaN), ``w`` ``[n, k]``, ``b`` ``[n]`` or None."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * k if swiglu else k
    buf = torch.full((m, width + 8), math.nan)
    buf[:, :width] = torch.randn(m, width, generator=gen)
    x = buf.to(DEVICE, dtype)[:, :width]
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


def reference(x, w, b, swiglu: bool) -> torch.Tensor:
    """float64 ``F.linear`` of the operands as the kernel rounds them (the activation via torch's silu_and_mul)."""
    if swiglu:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(fused_ops.FUSED_ENV, "0")
            x = fused_ops.silu_and_mul(x)
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.isfinite().all(), "non-finite output (unwritten, or read outside the input)"
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,bias,swiglu", [
    (1, 40, 200, False, False), (3, 64, 256, True, False), (17, 50, 300, False, True),
    (33, 16, 96, True, True), (64, 70, 130, False, False), (8, 100, 384, False, True),
])
def test_decode_gemm_matches_torch(monkeypatch, m, n, k, bias, swiglu, dtype):
    """Shapes off the tiles (N, K not multiples of 16/64, K under and over the head), M 1..64."""
    x, w, b = operands(m, n, k, dtype, bias, swiglu, seed=m)
    nan_empty(monkeypatch)
    y = tg.decode_gemm(x, w, b, swiglu, SMALL)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_err(y, reference(x, w, b, swiglu)) < TOL


def test_decode_gemm_default_config(monkeypatch):
    x, w, b = operands(5, 48, 320, torch.float16, True, True)
    nan_empty(monkeypatch)
    assert rel_err(tg.decode_gemm(x, w, b, swiglu=True), reference(x, w, b, True)) < TOL


def test_decode_gemm_rejects_bad_inputs():
    x, w, b = operands(4, 32, 64, torch.float16, True, False)
    bad = [((x[:0], w), "1 to"), ((torch.zeros(65, 64, dtype=x.dtype, device=DEVICE), w), "1 to"),
           ((x.float(), w.float()), "dtype"), ((x, w.bfloat16()), "dtype"), ((x, w, b.float()), "dtype"),
           ((x, w[:, :32]), "does not fit"), ((x, w, b[:8]), "bias must be"), ((x[None], w), "2-D"),
           ((x.t().contiguous().t(), w), "contiguous"), ((x, w, None, True), "does not fit")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            tg.decode_gemm(*args)


def test_dispatch_follows_the_switch(monkeypatch):
    """``layers.linear`` runs the Triton GEMM only with ``DUETSERVE_DECODE_GEMM=triton`` and a decode-sized
    bf16/fp16 input; the modules' outputs agree either way (down_proj with the SiLU fused in)."""
    calls = []
    gemm = tg.decode_gemm
    monkeypatch.setattr(tg, "decode_gemm", lambda *a: calls.append(a[3]) or gemm(*a))
    torch.manual_seed(0)
    mlp = layers.SwiGLU(32, 48).to(DEVICE, torch.float16)
    proj = layers.Linear(32, 40, bias=True).to(DEVICE, torch.float16)
    x = torch.randn(6, 32, device=DEVICE, dtype=torch.float16)
    outputs = {}
    for mode in ("cublas", "triton"):
        monkeypatch.setenv(layers.DECODE_GEMM_ENV, mode)
        calls.clear()
        outputs[mode] = mlp(x), proj(x)
        assert calls == ([False, True, False] if mode == "triton" else [])  # gate_up, down (+SiLU), proj
    for out, ref in zip(outputs["triton"], outputs["cublas"], strict=True):
        assert rel_err(out, ref.double()) < TOL
    calls.clear()
    proj(torch.randn(65, 32, device=DEVICE, dtype=torch.float16))  # above MAX_M
    proj.float()(x.float())  # float32
    assert calls == []
    monkeypatch.setenv(layers.DECODE_GEMM_ENV, "cutlass")
    with pytest.raises(ValueError, match=layers.DECODE_GEMM_ENV):
        proj(x.float())


# --- GPU: bf16, Qwen3-8B shapes -------------------------------------------------------------------

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 7, 32, 64])
def test_decode_gemm_bf16_gpu(monkeypatch, m):
    for name, (n, k) in QWEN3_8B.items():
        swiglu = name == "down"
        x, w, b = operands(m, n, k, torch.bfloat16, name == "o", swiglu, seed=m)
        nan_empty(monkeypatch)
        assert rel_err(tg.decode_gemm(x, w, b, swiglu), reference(x, w, b, swiglu)) < TOL, name
        monkeypatch.undo()


@pytest.mark.gpu
@needs_cuda
def test_pdl_chain_in_cuda_graph_matches_cublas(monkeypatch):
    """With the switch on, a Hopper GPU launches the GEMM with PDL (its PTX loads weights, then waits
    on the grid dependency) and a captured norm -> qkv -> norm -> gate_up -> down chain replays to
    cuBLAS's result."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9")
    launches = []
    kernel = tg._gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["launch_pdl"], kernel[grid](*args, **kwargs)))
            return launch

    monkeypatch.setattr(tg, "_gemm_kernel", Spy())
    torch.manual_seed(0)
    hidden, inter = 512, 1024
    norm = layers.RMSNorm(hidden, 1e-6).cuda().bfloat16()
    qkv = layers.Linear(hidden, 3 * hidden).cuda().bfloat16()
    mlp = layers.SwiGLU(hidden, inter).cuda().bfloat16()
    for p in (*qkv.parameters(), *mlp.parameters()):
        p.data.normal_(0, hidden ** -0.5)

    def chain(x):
        h, res = norm(x)
        h, _ = norm(qkv(h)[:, :hidden], res)
        return mlp(h)

    x = torch.randn(8, hidden, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv(layers.DECODE_GEMM_ENV, "cublas")
    expected = chain(x)
    assert not launches
    monkeypatch.setenv(layers.DECODE_GEMM_ENV, "triton")
    static = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static)  # compile
    torch.cuda.current_stream().wait_stream(side)
    assert launches and all(pdl for pdl, _ in launches)
    ptx = launches[0][1].asm["ptx"]
    assert -1 < ptx.find("ld.global") < ptx.find("griddepcontrol.wait")  # the weight head is read before the wait
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, expected.double()) < TOL
