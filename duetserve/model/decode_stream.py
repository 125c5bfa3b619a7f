"""Decode steps of at most 8 sequences through weight-stream kernels (issue 5; experimental).

``csrc/decode_stream.cu`` (built with ``OWN_WEIGHTS``) runs everything of a Qwen3 decode step but
attention, the final norm and lm_head: per layer o + residual, post-attention RMSNorm + gate_up +
SiLU-and-mul, down + residual, then the next layer's input RMSNorm + qkv and q/k-norm + RoPE + KV
write, each phase after a grid barrier, in one launch between two of the engine's Triton decode
attentions (37 launches a step for 36 layers). One CTA per SM; a producer warp streams the weights
into a shared-memory ring with bulk copies (TMA) without stopping at the barriers, a stage 8 whole
weight rows (64 KB at hidden size 4096: one contiguous copy). It reads the model's own weights (a
per-layer pointer table) and the engine's paged KV cache.

Needs an sm_90 GPU, ``nvcc`` (the kernel is compiled on first use and cached under
``$DUETSERVE_CACHE``, default ``~/.cache/duetserve``, ``kernels/``) and ``cuda-bindings`` (the
driver API: module load, launch, the parameter block's copy, all on torch's current stream, so a
step can be recorded in a CUDA graph). Measured in docs/benchmarks.md (twelfth to fourteenth and
twentieth H200 sessions) as ``scripts/bench_decode_stream.py``: a step of 1-8 sequences to the logits
0.05-0.08 ms faster than the replay of the engine's decode graph, and -0.06 to +0.01 ms in the
engine's 8-step decode, with the same bf16 drift from the eager forward as builds on weight copies
(``serve --decode-stream`` is off by default).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from duetserve.model.attention import AttentionMetadata
from duetserve.model.decoder import CausalLM

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_stream.cu"
MAX_ROWS = 8  # sequences a step (the kernel's MR)
PHASES = 5  # phases a layer (the kernel's phase numbering)
THREADS = 288  # 8 consumer warps and the producer
LAYOUTS = ("groups", "tiled")  # the kernel's OWN_WEIGHTS 1 and 0 (its header says what each reads)
RING_BYTES = 196608  # shared memory for the ring of a ``groups`` build
# The kernel's Params, in order (8 bytes each; after them eps and a spare float32)
FIELDS = ("wqkv", "wo", "wgu", "wdown", "qnorm", "knorm", "cos", "sin", "kv", "kv_stride", "layer_stride",
          "block_size", "positions", "slots", "block_tables", "bt_stride", "ctx_lens", "stream", "qkv", "attn", "h",
          "down", "qrot", "counter", "gcount", "wtab", "m", "mode")


def pack_params(values: dict, eps: float) -> np.ndarray:
    """``FIELDS`` of ``values`` (ints: pointers, strides, counts; missing ones 0) then ``eps``, as the
    kernel's ``Params`` bytes: ``[len(FIELDS) + 1]`` int64."""
    tail = np.array([eps, 0.0], dtype=np.float32).view(np.int64)
    return np.array([int(values.get(f, 0)) for f in FIELDS] + [int(tail[0])], dtype=np.int64)


def kernel_defines(model: CausalLM, stages: int | None = None, layout: str = "groups") -> dict[str, int]:
    """The kernel's compile-time dims for ``model`` and its ``layout`` of the weight stream (``LAYOUTS``):
    ``groups`` (the default) reads the model's own weights, a ring stage 8 whole rows of a K part (one
    contiguous bulk copy; as many stages as fit ``RING_BYTES``, at least 2); ``tiled`` reads
    stream-layout weight copies (``scripts/bench_decode_stream.py``; 16 x 512 tiles, 9 stages).
    ``stages`` overrides the ring's stage count.

    Raises:
        ValueError: shapes the kernel does not take: head dim other than 128, hidden size other
            than heads x head dim, hidden size not a multiple of 512 or above 4096 (one K part),
            intermediate size not a multiple of the hidden size, biases, or no q/k norms.
    """
    d = model.dims
    ok = (d.head_dim == 128 and d.hidden_size == d.num_heads * d.head_dim and d.hidden_size % 512 == 0
          and d.hidden_size <= 4096 and d.intermediate_size % d.hidden_size == 0 and d.qk_norm
          and not d.attention_bias and not d.mlp_bias)
    if not ok:
        raise ValueError("the decode stream takes Qwen3-like shapes only: head dim 128, hidden = heads x 128 "
                         "<= 4096 and a multiple of 512, intermediate a multiple of hidden, q/k norms, no biases")
    if layout not in LAYOUTS:
        raise ValueError(f"the decode stream's layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    groups = layout == "groups"
    return {"HID": d.hidden_size, "INTER": d.intermediate_size, "HQ": d.num_heads, "HKV": d.num_kv_heads,
            "HD": d.head_dim, "KPART": d.hidden_size,
            "NSTAGE": stages or (max(2, RING_BYTES // (16 * d.hidden_size)) if groups else 9),
            "OWN_WEIGHTS": int(groups), "KC": 512}


def cache_dir() -> Path:
    return Path(os.environ.get("DUETSERVE_CACHE") or Path.home() / ".cache" / "duetserve") / "kernels"


def build_cubin(defines: dict[str, int], arch: str = "sm_90a") -> Path:
    """Compile ``csrc/decode_stream.cu`` with ``defines`` for ``arch`` (nvcc), once: the cubin is cached
    under ``cache_dir()`` by a hash of the sources and flags.

    Raises:
        RuntimeError: no nvcc on PATH (or in /usr/local/cuda/bin), or the compile failed (its output).
    """
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None:
        raise RuntimeError("the decode stream needs nvcc (the CUDA toolkit) to compile its kernel")
    flags = ["-cubin", f"-gencode=arch=compute_{arch[3:]},code={arch}", "-O3",
             *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    digest = hashlib.sha256(" ".join(flags).encode())
    for src in sorted(SOURCE.parent.glob("*.cu*")):
        digest.update(src.read_bytes())
    out = cache_dir() / f"decode_stream_{digest.hexdigest()[:16]}.cubin"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run([nvcc, *flags, "-o", str(tmp), str(SOURCE)], check=False, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"nvcc failed to compile {SOURCE.name}:\n{run.stderr[-4000:]}")
        tmp.replace(out)
    return out


def _check(result):
    """A cuda.bindings call's results without its leading CUresult; RuntimeError if it is not success."""
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


class _Kernel:
    """The loaded ``decode_stream`` kernel: launches and its ``__constant__`` parameter block."""

    def __init__(self, cubin: Path):
        from cuda.bindings import driver

        _check(driver.cuInit(0))
        self.driver = driver
        image = np.frombuffer(cubin.read_bytes(), dtype=np.uint8)
        self.module = _check(driver.cuModuleLoadData(image.ctypes.data))
        self.function = _check(driver.cuModuleGetFunction(self.module, b"decode_stream"))
        smem_fn = _check(driver.cuModuleGetFunction(self.module, b"decode_stream_smem"))
        out = torch.zeros(1, dtype=torch.int32, device="cuda")
        self._launch(smem_fn, 1, 1, 0, ((out.data_ptr(),), (ctypes.c_void_p,)))
        self.smem = int(out.item())
        _check(driver.cuFuncSetAttribute(
            self.function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem))
        self.params_ptr, self.params_size = _check(driver.cuModuleGetGlobal(self.module, b"c_params"))

    def _launch(self, function, grid: int, block: int, smem: int, args) -> None:
        stream = self.driver.CUstream(torch.cuda.current_stream().cuda_stream)
        _check(self.driver.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, smem, stream, args, 0))

    def set_params(self, params: torch.Tensor) -> None:
        """Copy ``params`` (int64 on the device) into the parameter block, on the current stream."""
        stream = self.driver.CUstream(torch.cuda.current_stream().cuda_stream)
        _check(self.driver.cuMemcpyDtoDAsync(self.params_ptr, params.data_ptr(), params.numel() * 8, stream))

    def launch(self, sms: int, phase_begin: int, phase_end: int) -> None:
        self._launch(self.function, sms, THREADS, self.smem,
                     ((phase_begin, phase_end), (ctypes.c_int, ctypes.c_int)))


class DecodeStream:
    """Decode steps of ``model`` for at most ``MAX_ROWS`` sequences through the weight-stream kernels.

    Args:
        model: a Qwen3-shaped ``CausalLM`` on an sm_90 GPU (``kernel_defines`` says which).
        kv_caches: the engine's per-layer ``(k_cache, v_cache)``, slices of one allocation
            (``allocate_kv_cache``), each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        sms: SMs the kernels may use; every CTA must be resident at once (one per SM).
        defines: the kernel's build (``kernel_defines``; default ``kernel_defines(model)``).

    Attributes:
        extra_params: more ``FIELDS`` values for the parameter block (benchmarks: the kernel's
            mode bits, or the stream-layout weights of a ``tiled`` build).

    Raises:
        ValueError: shapes the kernel does not take, or caches that are not one allocation.
        RuntimeError: no nvcc, a failed compile, or a failed driver call.
    """

    MAX_ROWS = MAX_ROWS

    def __init__(self, model: CausalLM, kv_caches, sms: int | None = None, defines: dict[str, int] | None = None):
        self.model, self.d = model, model.dims
        self.kernel = _Kernel(build_cubin(defines or kernel_defines(model)))
        self.extra_params: dict[str, int] = {}
        self.sms = sms or torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        d, dev = self.d, kv_caches[0][0].device
        layers = model.model.layers
        self.wtab = torch.tensor([[t.data_ptr() for t in (
            ly.self_attn.qkv_proj.weight, ly.self_attn.o_proj.weight, ly.mlp.gate_up_proj.weight,
            ly.mlp.down_proj.weight, ly.input_layernorm.weight, ly.post_attention_layernorm.weight,
            ly.self_attn.q_norm.weight, ly.self_attn.k_norm.weight)] for ly in layers], dtype=torch.int64, device=dev)
        self.kv = kv_caches
        base, es = kv_caches[0][0], kv_caches[0][0].element_size()
        strides = {(kv_caches[i][j].data_ptr() - base.data_ptr()) for i in range(len(layers)) for j in (0, 1)}
        self.kv_stride = (kv_caches[0][1].data_ptr() - base.data_ptr()) // es
        self.layer_stride = (kv_caches[1][0].data_ptr() - base.data_ptr()) // es if len(layers) > 1 else 0
        if strides != {(i * self.layer_stride + j * self.kv_stride) * es for i in range(len(layers)) for j in (0, 1)}:
            raise ValueError("the decode stream needs the KV caches of all layers in one allocation")

        def z(*shape, dtype=torch.bfloat16):
            return torch.zeros(*shape, dtype=dtype, device=dev)
        n = d.intermediate_size
        self.stream, self.attn = z(MAX_ROWS, d.hidden_size), z(MAX_ROWS, d.num_heads * d.head_dim)
        self.qkv = z(MAX_ROWS, (d.num_heads + 2 * d.num_kv_heads) * d.head_dim)
        self.h, self.qrot = z(MAX_ROWS, n), z(MAX_ROWS, d.num_heads, d.head_dim)
        self.down = z(n // d.hidden_size, MAX_ROWS, d.hidden_size, dtype=torch.float32)
        self.counter = z(1, dtype=torch.int32)
        self.gcount = z(d.hidden_size // 8, dtype=torch.int32)  # a down row group's parts done (groups of 8 or 16)
        self.attn_counters = z(MAX_ROWS * d.num_kv_heads, dtype=torch.int32)
        self.params: dict[tuple, torch.Tensor] = {}  # per (step inputs' pointers, m, extras): one parameter block

    def _params(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = positions.shape[0]
        key = (positions.data_ptr(), meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
               meta.block_tables.stride(0), meta.context_lens.data_ptr(), m, tuple(sorted(self.extra_params.items())))
        if key not in self.params:
            rotary, base = self.model.rotary, self.kv[0][0]
            values = {"cos": rotary.cos.data_ptr(), "sin": rotary.sin.data_ptr(), "kv": base.data_ptr(),
                      "kv_stride": self.kv_stride, "layer_stride": self.layer_stride, "block_size": base.shape[1],
                      "positions": positions.data_ptr(), "slots": meta.slot_mapping.data_ptr(),
                      "block_tables": meta.block_tables.data_ptr(), "bt_stride": meta.block_tables.stride(0),
                      "ctx_lens": meta.context_lens.data_ptr(), "stream": self.stream.data_ptr(),
                      "qkv": self.qkv.data_ptr(), "attn": self.attn.data_ptr(), "h": self.h.data_ptr(),
                      "down": self.down.data_ptr(), "qrot": self.qrot.data_ptr(), "counter": self.counter.data_ptr(),
                      "gcount": self.gcount.data_ptr(), "wtab": self.wtab.data_ptr(), "m": m, **self.extra_params}
            self.params[key] = torch.from_numpy(pack_params(values, self.d.rms_norm_eps)).to(base.device)
        return self.params[key]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final-normed hidden states ``[m, hidden]`` of one decode token per sequence (``input_ids`` and
        ``positions`` ``[m]`` int64, ``meta`` a decode-only batch with int32 block tables and context
        lengths and int64 slots); writes the tokens' K/V into the cache. The inputs' storage is
        remembered (a CUDA graph replays with the same buffers).

        Raises:
            ValueError: more than ``MAX_ROWS`` sequences.
        """
        # imported here, on use only: it imports triton (see tests/test_decode_stream.py)
        from duetserve.model.triton_attention import paged_decode_attention

        m, d = input_ids.shape[0], self.d
        if m > MAX_ROWS:
            raise ValueError(f"the decode stream takes at most {MAX_ROWS} sequences, got {m}")
        self.kernel.set_params(self._params(positions, meta))
        self.counter.zero_()
        self.stream[:m].copy_(self.model.model.embed_tokens(input_ids))
        begin, attn = 0, self.attn[:m].view(m, d.num_heads, d.head_dim)
        for layer in range(d.num_layers):
            self.kernel.launch(self.sms, begin, layer * PHASES + 2)
            begin = layer * PHASES + 2
            paged_decode_attention(self.qrot[:m], *self.kv[layer], meta.block_tables, meta.context_lens,
                                   d.head_dim ** -0.5, out=attn, counters=self.attn_counters)
        self.kernel.launch(self.sms, begin, d.num_layers * PHASES)
        return self.model.model.norm(self.stream[:m])[0]
