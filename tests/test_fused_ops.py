"""Fused Triton ops (add+RMSNorm, q/k-norm+RoPE with or without the KV-cache write, SiLU-and-mul)
against their torch references.

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
from duetserve.model.attention import write_kv

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


def make_qkv(t, hq, hkv, d, dtype, gen):
    """q ``[t, hq, d]``, k and v ``[t, hkv, d]`` as views of one fused QKV row, like the model's."""
    qkv = padded_rows(t, (hq + 2 * hkv) * d, dtype, gen)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def rope_inputs(t, d, dtype, norm: bool, gen, max_pos=4096):
    """Positions ``[t]``, cos/sin tables ``[max_pos, d/2]`` and the norm weights (or Nones)."""
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(DEVICE)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float), 1e4 ** (-torch.arange(0, d, 2) / d))
    weights = [(torch.rand(d, generator=gen) + 0.5).to(DEVICE, dtype) for _ in range(2)] if norm else [None, None]
    return positions, freqs.cos().to(DEVICE), freqs.sin().to(DEVICE), weights


def check_rope(t, hq, hkv, d, dtype, tol, norm: bool, seed=0, max_pos=4096):
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = make_qkv(t, hq, hkv, d, dtype, gen)
    positions, cos, sin, weights = rope_inputs(t, d, dtype, norm, gen, max_pos)
    out = poisoned(tf.apply_rope, positions, q, k, cos, sin, *weights, 1e-6)
    ref = torch_path(fused_ops.apply_rope, positions, q, k, cos, sin, *weights, 1e-6)
    for o, r in zip(out, ref, strict=True):
        assert rel_err(o, r) < tol


def check_rope_and_cache(t, hq, hkv, d, block_size, dtype, tol, norm: bool, padding: int = 0, seed=0):
    """The fused RoPE + KV-cache write against Triton RoPE then ``write_kv`` (bit for bit) and
    against the torch path (within ``tol``). Tokens go to random distinct slots; ``padding`` more
    rows all go to one scratch slot, as a CUDA-graph bucket's padding rows do."""
    gen = torch.Generator().manual_seed(seed)
    rows = t + padding
    q, k, v = make_qkv(rows, hq, hkv, d, dtype, gen)
    positions, cos, sin, weights = rope_inputs(rows, d, dtype, norm, gen)
    num_blocks = -(-rows // block_size) + 2
    scratch = num_blocks * block_size - 1
    slots = torch.randperm(scratch, generator=gen)[:t].tolist() + [scratch] * padding
    slot_mapping = torch.tensor(slots, device=DEVICE)
    cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(DEVICE, dtype)
    fused, unfused, ref = ([cache.clone(), cache.clone()] for _ in range(3))
    q_fused = poisoned(tf.apply_rope_and_cache, positions, q, k, v, cos, sin, *fused, slot_mapping, *weights, 1e-6)
    q_unfused, k_unfused = tf.apply_rope(positions, q, k, cos, sin, *weights, 1e-6)
    write_kv(k_unfused, v, *unfused, slot_mapping)
    q_ref = torch_path(fused_ops.apply_rope_and_cache, positions, q, k, v, cos, sin, *ref, slot_mapping, *weights,
                       1e-6)
    assert torch.equal(q_fused, q_unfused)
    assert rel_err(q_fused, q_ref) < tol
    owned = torch.ones(num_blocks * block_size, dtype=torch.bool)
    owned[scratch] = not padding  # padding rows race for the scratch slot: any of them may win, per element
    for c_fused, c_unfused, c_ref in zip(fused, unfused, ref, strict=True):
        c_fused, c_unfused, c_ref = (c.view(-1, hkv, d) for c in (c_fused, c_unfused, c_ref))
        assert torch.equal(c_fused[owned], c_unfused[owned])
        assert rel_err(c_fused[owned], c_ref[owned]) < tol
        assert c_fused[scratch].isfinite().all()


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


@pytest.mark.parametrize("t,padding", [(1, 0), (5, 3), (37, 0)])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64), (4, 4, 80)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_and_cache(t, padding, hq, hkv, d, block_size, norm):
    check_rope_and_cache(t, hq, hkv, d, block_size, torch.float32, FP32_TOL, norm, padding)


def test_rope_and_cache_argument_errors():
    q, k, v = make_qkv(2, 4, 2, 32, torch.float32, torch.Generator().manual_seed(0))
    positions, cos, sin, _ = rope_inputs(2, 32, torch.float32, False, torch.Generator().manual_seed(0))
    cache = torch.zeros(4, 16, 2, 32, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        tf.apply_rope_and_cache(positions, q, k, v, cos, sin, cache, cache.half(), slots)
    with pytest.raises(ValueError, match="strides"):
        tf.apply_rope_and_cache(positions, q, k, v, cos, sin, cache, cache[:2], slots)


@pytest.mark.parametrize("t", [1, 3, 300])
@pytest.mark.parametrize("n", [1536, 128, 1000])
def test_silu_and_mul(t, n):
    check_silu_and_mul(t, n, torch.float32, FP32_TOL)


def test_half_precision():
    """fp16 rounds where bf16 does on the GPU (the interpreter gets bf16 wrong)."""
    check_rms_norm(33, 576, torch.float16, HALF_TOL, True)
    check_rope(33, 16, 8, 64, torch.float16, HALF_TOL, True)
    check_rope_and_cache(33, 16, 8, 64, 16, torch.float16, HALF_TOL, True, padding=2)
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
            check_rope_and_cache(t, hq, hkv, d, 16, torch.bfloat16, HALF_TOL, norm, padding=3, seed=t)
    for n in (12288, 1536, 17408):
        check_silu_and_mul(t, n, torch.bfloat16, HALF_TOL, seed=t)


@pytest.mark.gpu
@needs_cuda
def test_fused_ops_are_used_on_cuda(monkeypatch):
    """On CUDA the model's ops dispatch to Triton by default."""
    monkeypatch.delenv(fused_ops.FUSED_ENV, raising=False)
    assert fused_ops.use_triton(torch.ones(1, device="cuda"))
