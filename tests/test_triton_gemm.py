"""The Triton decode GEMM (``triton_gemm.decode_gemm``) against torch, and its dispatch
(``layers.linear``: decode-sized inputs, weights of at most ``MAX_N`` rows, the switch).

Without CUDA the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set for this
module's tests only) on small shapes and tiles, in float16 and bfloat16: the interpreter's
``tl.dot`` multiplies bfloat16 bit patterns as integers (numpy has no bfloat16), so on a CPU the
``bf16_dot`` fixture upcasts its bfloat16 operands to float32 first, as the GPU's MMA does in
effect (products of bf16 values are exact in float32), and makes the interpreter's float32 to
bfloat16 casts round to nearest (it truncates). Outputs are compared in float64 by relative error
against ``F.linear`` of the same rounded operands, and allocated outputs start as NaN, so an
element left unwritten shows up. A tiny Qwen3 engine's logits with the switch on match those
with it off.
The ``gpu`` tests use Qwen3-8B's shapes in bfloat16, check the programmatic-dependent-launch path
and replay a captured CUDA graph against cuBLAS.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import CUDA, import_triton_module

from duetserve.model import layers

DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = 1e-2

tg = import_triton_module("duetserve.model.triton_gemm")
pytestmark = pytest.mark.usefixtures("triton_interpreter", "bf16_dot")
SMALL = tg.GemmConfig(block_n=16, block_k=64, head_k=128, num_warps=4, num_stages=2)


@pytest.fixture
def bf16_dot(monkeypatch):
    """On a CPU: the interpreter's ``tl.dot`` on bfloat16 operands computes in float32 instead, and its
    float32 -> bfloat16 casts round to nearest even (as the GPU and torch do) instead of truncating."""
    if CUDA:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    create_dot, cast_impl = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def dot(self, a, b, *rest):
        a, b = (self.cast_impl(h, tl.float32) if h.dtype.scalar == tl.bfloat16 else h for h in (a, b))
        return create_dot(self, a, b, *rest)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data, np.float32)).bfloat16().view(torch.int16)
            return TensorHandle(bits.numpy().view(np.uint16), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", dot)
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", cast)


@pytest.fixture
def gemm_mode(monkeypatch):
    """A setter of ``DUETSERVE_DECODE_GEMM`` (``layers.decode_gemm_mode`` reads it again); unset after the test."""
    def set_mode(mode: str):
        monkeypatch.setenv(layers.DECODE_GEMM_ENV, mode)
        layers.decode_gemm_mode.cache_clear()

    yield set_mode
    monkeypatch.delenv(layers.DECODE_GEMM_ENV, raising=False)
    layers.decode_gemm_mode.cache_clear()


def nan_empty(monkeypatch):
    """Every float tensor ``torch.empty`` allocates from now on starts as NaN."""
    empty = torch.empty

    def alloc(*a, **kw):
        x = empty(*a, **kw)
        return x.fill_(math.nan) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", alloc)


def operands(m, n, k, dtype, bias: bool, seed=0):
    """``x`` ``[m, k]`` (rows ``k + 8`` apart, gaps NaN), ``w`` ``[n, k]``, ``b`` ``[n]`` or None."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((m, k + 8), math.nan)
    buf[:, :k] = torch.randn(m, k, generator=gen)
    x = buf.to(DEVICE, dtype)[:, :k]
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


def reference(x, w, b) -> torch.Tensor:
    """float64 ``F.linear`` of the operands."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.isfinite().all(), "non-finite output (unwritten, or read outside the input)"
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,bias", [
    (1, 40, 200, False), (3, 64, 256, True), (16, 70, 130, False), (11, 50, 300, True), (5, 100, 384, True),
    (13, 64, 96, False),
])
def test_decode_gemm_matches_torch(monkeypatch, m, n, k, bias, dtype):
    """Shapes off the tiles (N, K not multiples of 16/64, K under and over the head), M 1..16."""
    x, w, b = operands(m, n, k, dtype, bias, seed=m)
    nan_empty(monkeypatch)
    y = tg.decode_gemm(x, w, b, SMALL)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_err(y, reference(x, w, b)) < TOL


def test_accesses_before_wait_reads_ptx_order():
    ptx = "ld.global.v4.b32 a;\nld.global.b16 b;\ngriddepcontrol.wait;\nst.global.b16 c;\nld.global d;"
    assert tg.accesses_before_wait(ptx) == {"wait": True, "loads": 2, "stores": 0}
    early = "ld.global a;\nst.global.b32 b;\natom.global.add c;\ngriddepcontrol.wait;"
    assert tg.accesses_before_wait(early) == {"wait": True, "loads": 1, "stores": 2}
    assert tg.accesses_before_wait("ld.global a;")["wait"] is False


def test_decode_gemm_default_config(monkeypatch):
    x, w, b = operands(5, 48, 320, torch.float16, True)
    nan_empty(monkeypatch)
    assert rel_err(tg.decode_gemm(x, w, b), reference(x, w, b)) < TOL


def test_default_config_tiles():
    """32 weight rows a program up to WIDE_N, 64 beyond; 256-column tiles; stages that fit the budget:
    (160 KiB - 32 x 256 x 2 head) // ((32 + 16) x 256 x 2) = 6 -> 4; (160 KiB - 32 KiB) // 40 KiB = 3."""
    assert tg.default_config(6144, 4096) == tg.GemmConfig(32, 256, 256, 4, 4)
    assert tg.default_config(tg.WIDE_N, 12288) == tg.GemmConfig(32, 256, 256, 4, 4)
    assert tg.default_config(151936, 4096) == tg.GemmConfig(64, 256, 256, 4, 3)


def test_decode_gemm_rejects_bad_inputs():
    x, w, b = operands(4, 32, 64, torch.float16, True)
    bad = [((x[:0], w), "1 to"), ((torch.zeros(tg.MAX_M + 1, 64, dtype=x.dtype, device=DEVICE), w), "1 to"),
           ((x.float(), w.float()), "dtype"), ((x, w.bfloat16()), "dtype"), ((x, w, b.float()), "dtype"),
           ((x, w[:, :32]), "does not fit"), ((x, w, b[:8]), "bias must be"), ((x[None], w), "2-D"),
           ((x.t().contiguous().t(), w), "contiguous")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            tg.decode_gemm(*args)


def test_dispatch_follows_the_switch_rows_and_width(monkeypatch, gemm_mode):
    """While graphs are recorded (``graph_kernels``), by default (and with ``DUETSERVE_DECODE_GEMM=triton``)
    ``layers.Linear`` and ``SwiGLU``'s projections run the Triton GEMM on a bf16/fp16 input of at most
    ``MAX_M`` rows when the weight has at most ``MAX_N`` rows; ``cublas`` turns it off, and eager passes
    (outside the context) never use it; the modules' outputs agree either way."""
    calls = []
    gemm = tg.decode_gemm
    monkeypatch.setattr(tg, "decode_gemm", lambda x, w, *a, **kw: calls.append(w.shape[0]) or gemm(x, w, *a, **kw))
    monkeypatch.setattr(tg, "MAX_N", 64)  # gate_up (96 rows) too wide, down (32) and proj (40) not
    torch.manual_seed(0)
    mlp = layers.SwiGLU(32, 48, bias=True).to(DEVICE, torch.float16)
    proj = layers.Linear(32, 40, bias=True).to(DEVICE, torch.float16)
    x = torch.randn(6, 32, device=DEVICE, dtype=torch.float16)
    outputs = {}
    for mode in ("cublas", "triton", None):
        if mode:
            gemm_mode(mode)
        else:
            monkeypatch.delenv(layers.DECODE_GEMM_ENV)
            layers.decode_gemm_mode.cache_clear()
        calls.clear()
        mlp(x), proj(x)
        assert calls == []  # eager
        with layers.graph_kernels():
            outputs[mode] = mlp(x), proj(x)
        assert calls == ([] if mode == "cublas" else [32, 40])  # down, proj; gate_up on cuBLAS
        assert not layers.graph_kernels_enabled()
    for mode in ("triton", None):
        for out, ref in zip(outputs[mode], outputs["cublas"], strict=True):
            assert rel_err(out, ref.double()) < TOL
    calls.clear()
    big = torch.randn(tg.MAX_M + 1, 32, device=DEVICE, dtype=torch.float16)  # 17 rows: cuBLAS
    with layers.graph_kernels():
        proj(big), mlp(big)
        proj.float()(x.float())  # float32
    assert calls == []
    gemm_mode("cutlass")
    with pytest.raises(ValueError, match=layers.DECODE_GEMM_ENV):
        with layers.graph_kernels():
            pass


def test_graph_kernels_is_per_thread_and_nests(gemm_mode):
    """Another thread's forward passes stay eager while this one records; leaving an inner context
    keeps the outer one."""
    import threading

    gemm_mode("triton")
    seen = []
    with layers.graph_kernels():
        with layers.graph_kernels():
            pass
        worker = threading.Thread(target=lambda: seen.append(layers.graph_kernels_enabled()))
        worker.start()
        worker.join()
        assert layers.graph_kernels_enabled()
    assert seen == [False] and not layers.graph_kernels_enabled()
    gemm_mode("cublas")
    with layers.graph_kernels():
        assert not layers.graph_kernels_enabled()


def test_without_triton_the_layers_stay_on_cublas(monkeypatch):
    """Where triton does not import, graph recording runs the layers on cuBLAS instead of failing."""
    monkeypatch.setattr(layers, "_gemm_kernels", lambda: None)
    proj = layers.Linear(32, 40).to(DEVICE, torch.float16)
    x = torch.randn(4, 32, device=DEVICE, dtype=torch.float16)
    with layers.graph_kernels():
        assert layers.graph_kernels_enabled() and not layers.use_decode_gemm(x, proj.weight)
        assert torch.equal(proj(x), F.linear(x, proj.weight, proj.bias))


def test_tiny_qwen3_logits_with_the_switch(monkeypatch, gemm_mode, tiny_qwen3_folder):
    """A tiny Qwen3 engine in bfloat16, every forward pass run as if recorded into a graph
    (``graph_kernels``): greedy tokens and every step's logits (prefills of up to 16 rows and decodes
    through the Triton GEMMs, the 20-token prefill chunk through cuBLAS) equal the cuBLAS run's
    within bf16 rounding."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine
    from duetserve.sampling import SamplingParams

    calls = []
    gemm = tg.decode_gemm
    monkeypatch.setattr(tg, "decode_gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or gemm(*a, **kw))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 9, 20)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("cublas", "triton"):
        gemm_mode(mode)
        engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), dtype="bfloat16", max_num_batched_tokens=16,
                                        num_kv_blocks=32, block_size=8))
        logits = []
        engine.model.compute_logits = lambda h, out=None, log=logits, compute=engine.model.compute_logits: \
            log.append(compute(h, out)) or log[-1]
        with layers.graph_kernels():
            runs[mode] = engine.generate(prompts, params), logits
    assert calls and max(calls) == tg.MAX_M  # 5 + 9 prompt rows and 2 of the third in one step
    assert runs["triton"][0] == runs["cublas"][0]
    for out, ref in zip(runs["triton"][1], runs["cublas"][1], strict=True):
        assert rel_err(out, ref.double()) < TOL


# --- GPU: bf16, Qwen3-8B shapes -------------------------------------------------------------------

QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 7, 16])
def test_decode_gemm_bf16_gpu(monkeypatch, m):
    for name, (n, k) in QWEN3_8B.items():
        x, w, b = operands(m, n, k, torch.bfloat16, name == "o", seed=m)
        nan_empty(monkeypatch)
        assert rel_err(tg.decode_gemm(x, w, b), reference(x, w, b)) < TOL, name
        monkeypatch.undo()


@pytest.mark.gpu
@needs_cuda
def test_pdl_chain_in_cuda_graph_matches_cublas(monkeypatch, gemm_mode):
    """With the switch on, a Hopper GPU launches the GEMMs with PDL (each one's PTX loads weights, then
    waits on the grid dependency) and a captured norm -> qkv -> norm -> gate_up -> SiLU-and-mul ->
    down chain replays to cuBLAS's result."""
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
    gemm_mode("cublas")
    with layers.graph_kernels():
        expected = chain(x)
    gemm_mode("triton")
    chain(x)  # eager: cuBLAS
    assert not launches
    static = torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with layers.graph_kernels():
        with torch.cuda.stream(side):
            chain(static)  # compile
        torch.cuda.current_stream().wait_stream(side)
        assert len(launches) == 3 and all(pdl for pdl, _ in launches)  # qkv, gate_up, down
        for _, compiled in launches:
            ptx = compiled.asm["ptx"]
            seen = tg.accesses_before_wait(ptx)  # the weight head is read before the wait, nothing written
            assert seen["wait"] and seen["loads"] > 0 and seen["stores"] == 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, expected.double()) < TOL
