"""GPU experiment: one persistent kernel streams a decode step's weights without a break (issue 5).

``scripts/weight_stream/weight_stream.cu`` runs the four weight GEMMs of each Qwen3-8B layer (qkv,
o, gate_up with SiLU-and-mul, down) for 36 layers and M = 8 rows in ONE launch: a CTA per SM, a
producer warp streaming every weight tile the CTA owns into a shared-memory ring with bulk copies
(TMA), phase after phase and layer after layer, and eight consumer warps waiting at a grid barrier
for each phase's input. The weight stream never waits for a barrier; between kernels of the
engine it stops at every boundary. Attention, norms and RoPE are left out (o takes the first 4096
qkv columns), as in ``bench_decode_gemm.py``'s chain.

Kernel builds (``--kernels``): the ring depth, and ``r`` for ``ROWCOPY``, which reads the weights'
own ``[N, K]`` layout (16 one-row bulk copies a stage) instead of ``stream_layout``'s tiles.
Compared in one run, each in a CUDA graph, ms per 36 layers against the weight-read floor
(bytes / 4.19 TB/s): each build; each without its grid waits (wrong values; shows the barriers'
cost); each streaming and multiplying only (no input loads or epilogues); and the engine's
kernels for the same chain (Triton decode GEMM for qkv, o, down; cuBLAS gate_up; SiLU). Each
build is first checked against a float32 torch reference of 1 and 3 layers.

Needs a CUDA GPU of compute capability 9.0 with nvcc and CuPy (the lent H200's image has both).
Writes JSON to ``--out``; prints a short table last. Exit code 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HID, QKV, INTER, M, LAYERS = 4096, 6144, 12288, 8, 36
COPY_BW = 4.19e12
SOURCE = Path(__file__).resolve().parent / "weight_stream" / "weight_stream.cu"
TILE_ROWS, TILE_COLS, KPART, WARP_COLS = 16, 512, 4096, 64


def warp_slice_order() -> torch.Tensor:
    """Source column of each position of a 64-column warp slice ``[64]`` (int64).

    The mma's k-step ``ks`` (0-3), index ``kappa`` (0-15) takes column ``16 q + 4 ks + j`` with
    ``q = (kappa % 8) // 2`` and ``j = kappa % 2 + 2 (kappa // 8)``: then the B fragments lane
    ``q`` needs (``kappa`` in 2q, 2q+1, 2q+8, 2q+9 of every ``ks``) are the 16 contiguous input
    columns ``16 q .. 16 q + 15``, two 16-byte loads (``load_xb`` in the kernel)."""
    kappa = torch.arange(16)
    q, j = (kappa % 8) // 2, kappa % 2 + 2 * (kappa // 8)
    return torch.cat([16 * q + 4 * ks + j for ks in range(4)])


def stream_layout(w: torch.Tensor) -> torch.Tensor:
    """A weight ``[L, N, K]`` rearranged for the kernel's producer, same shape and dtype.

    Columns are permuted inside each 64-column warp slice (``warp_slice_order``); the result is
    stored as tiles ``[L, K / 4096, N / 16, 8, 16, 512]`` (K part, 16-row group, 512-column
    chunk), each tile one contiguous 16 KB block that one bulk copy moves, with the 16-byte
    chunks of tile row ``r`` XOR-swizzled by ``r % 8`` (``ldmatrix`` without bank conflicts).

    Raises:
        ValueError: N not a multiple of 16 or K not a multiple of 4096.
    """
    L, N, K = w.shape
    if N % TILE_ROWS or K % KPART:
        raise ValueError(f"weight [{N}, {K}] needs N % {TILE_ROWS} == 0 and K % {KPART} == 0")
    w = w[..., (torch.arange(K) // WARP_COLS * WARP_COLS).view(-1, WARP_COLS)
          .add(warp_slice_order()).view(-1).to(w.device)]
    t = w.reshape(L, N // TILE_ROWS, TILE_ROWS, K // KPART, KPART // TILE_COLS, TILE_COLS // 8, 8)
    t = t.permute(0, 3, 1, 4, 2, 5, 6)  # [L, part, group, chunk, row, 16-byte chunk, 8]
    row = torch.arange(TILE_ROWS, device=w.device)[:, None]
    chunk = torch.arange(TILE_COLS // 8, device=w.device)[None, :] ^ (row % 8)
    return t[:, :, :, :, row, chunk, :].contiguous().view(L, N, K)


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[L, I, K]`` gate and up -> ``[L, 2 I, K]`` in 16-row groups: 8 gate rows, then the same 8
    up rows (so one group's epilogue has both halves of SiLU(gate) * up)."""
    L, n, K = gate.shape
    return torch.stack([gate.view(L, n // 8, 8, K), up.view(L, n // 8, 8, K)], dim=2).reshape(L, 2 * n, K)


class Chain:
    """Random weights and activation buffers for ``layers`` layers (bf16 weights scaled 1/sqrt(K))."""

    def __init__(self, layers: int, keep_reference: bool, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)

        def rand(*shape):
            return (torch.randn(*shape, generator=g, device="cuda") / shape[-1] ** 0.5).to(torch.bfloat16)
        self.layers = layers
        self.qkv, self.o = rand(layers, QKV, HID), rand(layers, HID, HID)
        gate, up = rand(layers, INTER, HID), rand(layers, INTER, HID)
        self.gate_up = interleave_gate_up(gate, up)
        self.gate_up_rows = torch.cat([gate, up], dim=1)  # the engine's layout: [gate; up]
        self.down = rand(layers, HID, INTER)
        self.reference_weights = (gate, up) if keep_reference else None
        self.stream = [stream_layout(w) for w in (self.qkv, self.o, self.gate_up, self.down)]
        self.x0 = torch.randn(M, HID, generator=g, device="cuda").to(torch.bfloat16)
        z = lambda *s, dt=torch.bfloat16: torch.zeros(*s, device="cuda", dtype=dt)
        self.a_qkv, self.a_o, self.a_x, self.a_h = z(M, QKV), z(M, HID), z(M, HID), z(M, INTER)
        self.a_down = z(INTER // KPART, M, HID, dt=torch.float32)
        self.counter, self.gcount = z(1, dt=torch.int32), z(HID // TILE_ROWS, dt=torch.int32)

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.qkv, self.o, self.gate_up, self.down))

    def reference(self) -> torch.Tensor:
        """The last layer's output ``[M, HID]`` in float32 math, rounded to bf16 where the kernel rounds."""
        gate, up = self.reference_weights
        x = self.x0
        for layer in range(self.layers):
            qkv = (x.float() @ self.qkv[layer].float().T).to(torch.bfloat16)
            o = (qkv[:, :HID].float() @ self.o[layer].float().T).to(torch.bfloat16).float()
            h = (torch.nn.functional.silu(o @ gate[layer].float().T) * (o @ up[layer].float().T)).to(torch.bfloat16)
            x = (h.float() @ self.down[layer].float().T).to(torch.bfloat16)
        return x


def load_kernel(name: str, build: Path):
    """Compile the kernel ``name`` (ring stages, then ``r`` to read the weights' own ``[N, K]`` layout
    by one-row copies) with nvcc for sm_90a and load it with CuPy."""
    import cupy
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cubin = build / f"weight_stream_{name}.cubin"
    rows = name.endswith("r")
    subprocess.run([nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", f"-DNSTAGE={name.rstrip('r')}",
                    f"-DROWCOPY={int(rows)}", "-o", str(cubin), str(SOURCE)], check=True)
    module = cupy.RawModule(path=str(cubin))
    kernel = module.get_function("mk_chain")
    out = cupy.zeros(1, dtype=cupy.int32)
    module.get_function("mk_smem_size")((1,), (1,), (out,))
    smem = int(out.get()[0])
    kernel.max_dynamic_shared_size_bytes = smem
    return cupy, kernel, smem, rows


def launch(kernel, c: Chain, mode: int = 0) -> None:
    """``mode`` bit 0: no grid waits (wrong values); bit 1: stream and multiply only."""
    cupy, fn, smem, rows = kernel
    c.counter.zero_()
    p = lambda t: np.uint64(t.data_ptr())
    w = (c.qkv, c.o, c.gate_up_rows, c.down) if rows else c.stream
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        fn((torch.cuda.get_device_properties(0).multi_processor_count,), (288,),
           (p(w[0]), p(w[1]), p(w[2]), p(w[3]), p(c.x0), p(c.a_qkv), p(c.a_o), p(c.a_x), p(c.a_h), p(c.a_down),
            p(c.counter), p(c.gcount), np.uint64(0), np.int32(c.layers), np.int32(mode)), shared_mem=smem)


def engine_chain(c: Chain):
    """The same chain on the engine's decode kernels (gate_up's interleaved rows: same bytes and time)."""
    from duetserve.model.triton_fused import silu_and_mul
    from duetserve.model.triton_gemm import decode_gemm

    def run():
        x = c.x0
        for layer in range(c.layers):
            qkv = decode_gemm(x, c.qkv[layer])
            o = decode_gemm(qkv[:, :HID], c.o[layer])
            x = decode_gemm(silu_and_mul(o @ c.gate_up[layer].T), c.down[layer])
    return run


def events_ms(fn, replays: int = 20) -> float:
    """Median ms of ``fn`` between two CUDA events, after one call to warm it."""
    fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def graph_ms(fn, replays: int = 20) -> float:
    """Median ms of ``fn`` replayed in a CUDA graph (run once on a side stream before capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return events_ms(graph.replay, replays)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/weight_stream.json"))
    parser.add_argument("--kernels", nargs="+", default=["9", "9r"],
                        help="builds to compare: ring stages, then 'r' to read the weights' own [N, K] layout")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_weight_stream.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # CuPy's ExternalStream
    build = Path(tempfile.mkdtemp(prefix="weight_stream_"))
    kernels = {k: load_kernel(k, build) for k in args.kernels}
    checks = []
    for layers in (1, 3):
        c = Chain(layers, keep_reference=True)
        ref = c.reference().float()
        for s, k in kernels.items():
            outs = []
            for _ in range(2):
                launch(k, c)
                torch.cuda.synchronize()
                outs.append(c.a_x.clone())
            err = float((outs[0].float() - ref).norm() / ref.norm())
            checks.append({"layers": layers, "kernel": s, "rel_err": err, "deterministic": bool(torch.equal(*outs)),
                           "nan": bool(outs[0].float().isnan().any())})
            print(checks[-1], flush=True)
        del c
    torch.cuda.empty_cache()
    c = Chain(LAYERS, keep_reference=False)
    floor = c.weight_bytes() / COPY_BW * 1e3
    variants = []
    for name, k in kernels.items():
        variants += [(f"weight stream {name}", lambda k=k: launch(k, c)),
                     (f"  {name}, no grid waits (wrong values)", lambda k=k: launch(k, c, 1)),
                     (f"  {name}, stream + mma only", lambda k=k: launch(k, c, 2)),
                     (f"  {name}, stream + mma only, no waits", lambda k=k: launch(k, c, 3))]
    variants.append(("engine kernels (Triton GEMM, cuBLAS gate_up, SiLU)", engine_chain(c)))
    variants += [(f"weight stream {name}, again", lambda k=k: launch(k, c)) for name, k in kernels.items()]
    rows = []
    t0 = time.monotonic()
    for name, fn in variants:
        ms = graph_ms(fn)
        rows.append({"variant": name, "ms": ms, "ratio": ms / floor})
        print(f"{name}: {ms:.3f} ms", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"floor_ms": floor, "checks": checks, "rows": rows,
                                    "seconds": time.monotonic() - t0}, indent=1))
    print(f"\n{LAYERS} layers x (qkv, o, gate_up + SiLU, down), M = {M}; floor {floor:.3f} ms "
          f"({c.weight_bytes() / 1e9:.2f} GB at 4.19 TB/s)")
    for r in rows:
        print(f"{r['variant']:<55} {r['ms']:7.3f} ms  x{r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
