"""Fused Triton ops (add+RMSNorm, q/k-norm+RoPE, SiLU-and-mul) against their torch references.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set for this
module's tests only) in float32 and float16 (the interpreter gets bf16 wrong); the ``gpu`` tests
run bf16 on CUDA. Inputs are random normal (never zeros), outputs are compared in float64 by
relative error, and every Triton output is checked finite: tensors the kernels' wrappers
allocate start as NaN, and the inputs are views with NaN-poisoned gaps, so an element left
unwritten, or a read outside a view, shows up as NaN.
"""
from __future__ import annotations

import math

import pytest
import torch
from conftest import CUDA, import_triton_module

from duetserve.model import fused_ops

DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
FP32_TOL, HALF_TOL = 1e-5, 1e-2  # fp32 runs the same arithmetic as torch: tighter than the 1e-3 asked

tf = import_triton_module("duetserve.model.triton_fused")
pytestmark = pytest.mark.usefixtures("triton_interpreter")


def torch_path(fn, *args, **kwargs):
    """``fn`` (a ``fused_ops`` function) on its torch reference path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fused_ops.FUSED_ENV, "0")
        return fn(*args, **kwargs)


def poisoned(fn, *args):
    """``fn(*args)`` with every float tensor it allocates through ``torch.empty``/``empty_like`` NaN at first."""
    def poison(make):
        def alloc(*a, **kw):
            x = make(*a, **kw)
            return x.fill_(math.nan) if x.is_floating_point() else x
        return alloc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", poison(torch.empty))
        mp.setattr(torch, "empty_like", poison(torch.empty_like))
        return fn(*args)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.isfinite().all(), "non-finite output (unwritten, or read outside the input)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def padded_rows(t: int, n: int, dtype, gen: torch.Generator, pad: int = 8) -> torch.Tensor:
    """A random ``[t, n]`` view whose rows are ``n + pad`` apart, the gaps NaN."""
    buf = torch.full((t, n + pad), float("nan"))
    buf[:, :n] = torch.randn(t, n, generator=gen)
    return buf.to(DEVICE, dtype)[:, :n]


def check_rms_norm(t, n, dtype, tol, residual: bool, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = padded_rows(t, n, dtype, gen)
    res = torch.randn(t, n, generator=gen).to(DEVICE, dtype) if residual else None
    w = (torch.rand(n, generator=gen) + 0.5).to(DEVICE, dtype)
    out, new_res = poisoned(tf.rms_norm, x, w, 1e-6, res)
    ref, ref_res = torch_path(fused_ops.rms_norm, x, w, 1e-6, res)
    assert rel_err(out, ref) < tol
    assert rel_err(new_res, ref_res) < tol
    if residual:
        assert torch.equal(new_res, ref_res)  # one rounding of an exact fp32 sum either way
    else:
        assert new_res is x


def make_qk(t, hq, hkv, d, dtype, gen):
    """q ``[t, hq, d]`` and k ``[t, hkv, d]`` as views of one fused QKV row, like the model's."""
    qkv = padded_rows(t, (hq + 2 * hkv) * d, dtype, gen)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d)


def check_rope(t, hq, hkv, d, dtype, tol, norm: bool, seed=0, max_pos=4096):
    gen = torch.Generator().manual_seed(seed)
    q, k = make_qk(t, hq, hkv, d, dtype, gen)
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(DEVICE)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), 1e4 ** (-torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    weights = [(torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if norm else [None, None]
    out = poisoned(tf.apply_rope, positions, q, k, cos, sin, *weights, 1e-6)
    ref = torch_path(fused_ops.apply_rope, positions, q, k, cos, sin, *weights, 1e-6)
    for o, r in zip(out, ref, strict=True):
        assert rel_err(o, r) < tol


def check_silu_and_mul(t, n, dtype, tol, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = padded_rows(t, 2 * n, dtype, gen)
    assert rel_err(poisoned(tf.silu_and_mul, x), torch_path(fused_ops.silu_and_mul, x)) < tol


# --- CPU (interpreter) or GPU: fp32 and fp16 --------------------------------------------------

@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("n", [576, 4096, 100])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(t, n, residual):
    check_rms_norm(t, n, torch.float32, FP32_TOL, residual)


@pytest.mark.parametrize("t", [1, 5, 300])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (4, 2, 32), (4, 4, 80)])
@pytest.mark.parametrize("norm", [False, True])
def test_rope(t, hq, hkv, d, norm):
    check_rope(t, hq, hkv, d, torch.float32, FP32_TOL, norm)


@pytest.mark.parametrize("t", [1, 3, 300])
@pytest.mark.parametrize("n", [1536, 128, 1000])
def test_silu_and_mul(t, n):
    check_silu_and_mul(t, n, torch.float32, FP32_TOL)


def test_half_precision():
    """fp16 rounds where bf16 does on the GPU (the interpreter gets bf16 wrong)."""
    check_rms_norm(33, 576, torch.float16, HALF_TOL, True)
    check_rope(33, 16, 8, 64, torch.float16, HALF_TOL, True)
    check_silu_and_mul(33, 1536, torch.float16, HALF_TOL)


def test_dispatch(monkeypatch):
    x = torch.ones(2, 4)
    monkeypatch.setenv(fused_ops.FUSED_ENV, "auto")
    assert fused_ops.use_triton(x) == x.is_cuda
    monkeypatch.setenv(fused_ops.FUSED_ENV, "0")
    assert not fused_ops.use_triton(x.to(DEVICE))
    monkeypatch.setenv(fused_ops.FUSED_ENV, "1")
    assert fused_ops.use_triton(x)
    monkeypatch.setenv(fused_ops.FUSED_ENV, "yes")
    with pytest.raises(ValueError, match="0, 1 or auto"):
        fused_ops.use_triton(x)


def test_checkpoint_names_cover_merged_projections(tiny_qwen3_folder):
    """Every tensor of the HF checkpoint has a target of its shape; q/k/v and gate/up fill row slices in order."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from duetserve.model.attention import TorchAttention
    from duetserve.model.decoder import CausalLM

    lm = CausalLM(AutoConfig.from_pretrained(tiny_qwen3_folder), TorchAttention(), 64)
    targets = lm.checkpoint_tensors()
    with safe_open(str(tiny_qwen3_folder / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(targets)
        assert all(f.get_slice(key).get_shape() == list(targets[key].shape) for key in f.keys())
    attn = lm.model.layers[1].self_attn
    assert targets["model.layers.1.self_attn.k_proj.weight"].data_ptr() == attn.qkv_proj.weight[128:].data_ptr()
    assert targets["model.layers.1.mlp.up_proj.weight"].data_ptr() == \
        lm.model.layers[1].mlp.gate_up_proj.weight[128:].data_ptr()


def test_engine_greedy_fused_equals_torch(tiny_qwen3_folder, monkeypatch):
    """The tiny Qwen3 (q/k norm, GQA 2, head_dim 32) through the engine: chunked prefill, mixed
    batches and decodes give the same greedy tokens on the fused Triton ops as on torch."""
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine
    from duetserve.sampling import SamplingParams

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (4, 19, 40)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(fused_ops.FUSED_ENV, mode)
        engine = LLMEngine(EngineConfig(model=str(tiny_qwen3_folder), device=str(DEVICE), dtype="float32",
                                        max_num_batched_tokens=32, num_kv_blocks=64, block_size=8))
        tokens[mode] = engine.generate(prompts, params)
    assert tokens["1"] == tokens["0"]


# --- GPU: bf16 ----------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 2, 17, 300, 8192])
def test_fused_ops_bf16_gpu(t):
    """Qwen3-8B (hidden 4096, 32/8 heads of 128, intermediate 12288) and SmolLM2 (576, 9/3 of 64) shapes."""
    for residual in (False, True):
        for n in (4096, 576, 5120):
            check_rms_norm(t, n, torch.bfloat16, HALF_TOL, residual, seed=t)
    for norm in (False, True):
        for hq, hkv, d in ((32, 8, 128), (9, 3, 64), (40, 8, 128), (64, 4, 128)):
            check_rope(t, hq, hkv, d, torch.bfloat16, HALF_TOL, norm, seed=t, max_pos=40960)
    for n in (12288, 1536, 17408):
        check_silu_and_mul(t, n, torch.bfloat16, HALF_TOL, seed=t)


@pytest.mark.gpu
@needs_cuda
def test_fused_ops_are_used_on_cuda(monkeypatch):
    """On CUDA the model's ops dispatch to Triton by default."""
    monkeypatch.delenv(fused_ops.FUSED_ENV, raising=False)
    assert fused_ops.use_triton(torch.ones(1, device="cuda"))
