"""GPU experiment: a decode step as weight-stream kernels between the engine's decode attentions (issue 5).

``duetserve/model/csrc/decode_stream.cu`` runs everything of a Qwen3 decode step except attention,
lm_head and sampling: per layer o + residual, post-attention RMSNorm + gate_up + SiLU-and-mul, down
+ residual, the next layer's input RMSNorm + qkv and q/k-norm + RoPE + KV write, each phase after a
grid barrier, in ONE launch between two of the engine's Triton decode attentions (37 launches and
36 attentions a step, against nine kernels a layer in the engine's graphs). Inside a launch one
producer warp per SM streams the weights without stopping at phase boundaries
(``bench_weight_stream.py`` measures that part alone).

Kernel variants (``--variants``): ``tiled:STAGES`` reads copies of the weights in the stream
layout (``bench_weight_stream.stream_layout``, RMSNorm weights folded into qkv and gate_up: twice
the weight memory); ``rows:STAGES`` reads the engine's own weights (``ROWCOPY``); ``module`` is
``duetserve.model.decode_stream.DecodeStream`` (the rows kernel through the driver API, as
``serve --decode-stream`` runs it). Builds the engine with dummy Qwen3-8B weights (bf16, CUDA
graphs), then per shape (batch x context): checks each variant's final hidden states and the new
tokens' K/V against the engine's eager forward (bf16 rounding drifts over 36 layers: the engine's
own graphs and eager paths differ too, both are printed), and times one step (logits, no
sampling) in a CUDA graph against the engine's decode graph, with the floor
``bytes(weights + KV read) / 4.19 TB/s``.

Needs a CUDA GPU of compute capability 9.0 with nvcc, CuPy and cuda-bindings (the lent H200's image
has them).
Writes JSON to ``--out``; prints a short table last. Exit code 2 without CUDA.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from duetserve.model.decode_stream import FIELDS, DecodeStream, pack_params

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "duetserve" / "model" / "csrc" / "decode_stream.cu"
COPY_BW = 4.19e12
MR = 8  # rows (sequences) the kernel takes
PHASES = 5  # phases a layer
SHAPES = ((8, 512), (8, 2048), (8, 8192), (1, 512), (4, 2048))


@functools.cache
def _weight_stream():
    spec = importlib.util.spec_from_file_location("bench_weight_stream", HERE / "bench_weight_stream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BenchStream:
    """Stream-layout weights, buffers and CuPy launches for ``engine``'s model (Qwen3, at most 8 rows);
    the ``module`` variant runs ``duetserve.model.decode_stream.DecodeStream`` instead."""

    def __init__(self, engine):
        ws = _weight_stream()
        self.engine, self.model, d = engine, engine.model, engine.model.dims
        self.d = d
        layers = self.model.model.layers
        with torch.no_grad():
            def stack(fn):
                return torch.stack([fn(layer) for layer in layers])

            def fold(w, g):
                return (w.float() * g.float()[None, :]).to(torch.bfloat16)
            self.wqkv = ws.stream_layout(stack(lambda ly: fold(ly.self_attn.qkv_proj.weight, ly.input_layernorm.weight)))
            self.wo = ws.stream_layout(stack(lambda ly: ly.self_attn.o_proj.weight))
            gu = stack(lambda ly: fold(ly.mlp.gate_up_proj.weight, ly.post_attention_layernorm.weight))
            n = d.intermediate_size
            self.wgu = ws.stream_layout(ws.interleave_gate_up(gu[:, :n], gu[:, n:]))
            del gu
            self.wdown = ws.stream_layout(stack(lambda ly: ly.mlp.down_proj.weight))
            self.qnorm = stack(lambda ly: ly.self_attn.q_norm.weight).contiguous()
            self.knorm = stack(lambda ly: ly.self_attn.k_norm.weight).contiguous()
            # the rows kernels read the engine's own weights through a table of pointers, [L][8]
            self.wtab = torch.tensor([[t.data_ptr() for t in (
                ly.self_attn.qkv_proj.weight, ly.self_attn.o_proj.weight, ly.mlp.gate_up_proj.weight,
                ly.mlp.down_proj.weight, ly.input_layernorm.weight, ly.post_attention_layernorm.weight,
                ly.self_attn.q_norm.weight, ly.self_attn.k_norm.weight)] for ly in layers],
                dtype=torch.int64, device="cuda")
        torch.cuda.empty_cache()
        self.kv = engine.runner.kv_caches
        z = lambda *s, dt=torch.bfloat16: torch.zeros(*s, device="cuda", dtype=dt)
        self.stream, self.attn = z(MR, d.hidden_size), z(MR, d.num_heads * d.head_dim)
        self.qkv = z(MR, (d.num_heads + 2 * d.num_kv_heads) * d.head_dim)
        self.h, self.qrot = z(MR, n), z(MR, d.num_heads, d.head_dim)
        self.down = z(n // d.hidden_size, MR, d.hidden_size, dt=torch.float32)
        self.counter, self.gcount = z(1, dt=torch.int32), z(d.hidden_size // 16, dt=torch.int32)
        self.attn_counters = z(MR * d.num_kv_heads, dt=torch.int32)
        self.params = z(len(FIELDS) + 1, dt=torch.int64)
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self._built = {}

    def build(self, variant: str) -> None:
        """Compile the kernel ``variant`` (``tiled:STAGES``: the stream-layout copies; ``rows:STAGES``:
        the engine's own weights, ``ROWCOPY``) for this model (nvcc, sm_90a) and use it from now on."""
        import cupy
        if variant in self._built:
            self.kernel, self.smem, self.symbol, self.rows = self._built[variant]
            return
        layout, stages = variant.split(":")
        d = self.d
        path = Path(tempfile.mkdtemp(prefix="decode_stream_")) / "decode_stream.cubin"
        defs = {"HID": d.hidden_size, "INTER": d.intermediate_size, "HQ": d.num_heads, "HKV": d.num_kv_heads,
                "HD": d.head_dim, "KPART": d.hidden_size, "NSTAGE": stages, "ROWCOPY": int(layout == "rows")}
        subprocess.run([shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc", "-cubin",
                        "-gencode=arch=compute_90a,code=sm_90a", "-O3", *(f"-D{k}={v}" for k, v in defs.items()),
                        "-o", str(path), str(SOURCE)], check=True)
        module = cupy.RawModule(path=str(path))
        self.cupy, self.kernel = cupy, module.get_function("decode_stream")
        out = cupy.zeros(1, dtype=cupy.int32)
        module.get_function("decode_stream_smem")((1,), (1,), (out,))
        self.smem = int(out.get()[0])
        self.kernel.max_dynamic_shared_size_bytes = self.smem
        self.symbol = module.get_global("c_params")
        self.rows = layout == "rows"
        self._built[variant] = self.kernel, self.smem, self.symbol, self.rows

    def set_inputs(self, inputs, mode: int = 0) -> None:
        """The step's inputs (``ModelRunner._prepare`` of a decode-only batch); ``mode``: the kernel's
        mode bits (0 for real results)."""
        meta, base = inputs.meta, self.kv[0][0]
        self.inputs, self.m = inputs, inputs.input_ids.shape[0]
        if self.m > MR:
            raise ValueError(f"at most {MR} sequences, got {self.m}")
        ptr = {"wqkv": self.wqkv, "wo": self.wo, "wgu": self.wgu, "wdown": self.wdown, "qnorm": self.qnorm,
               "knorm": self.knorm, "cos": self.model.rotary.cos, "sin": self.model.rotary.sin, "kv": base,
               "positions": inputs.positions, "slots": meta.slot_mapping, "block_tables": meta.block_tables,
               "ctx_lens": meta.context_lens, "stream": self.stream, "qkv": self.qkv, "attn": self.attn, "h": self.h,
               "down": self.down, "qrot": self.qrot, "counter": self.counter, "gcount": self.gcount,
               "wtab": self.wtab}
        values = {k: t.data_ptr() for k, t in ptr.items()}
        es = base.element_size()
        values.update(kv_stride=(self.kv[0][1].data_ptr() - base.data_ptr()) // es,
                      layer_stride=(self.kv[1][0].data_ptr() - base.data_ptr()) // es,
                      block_size=self.engine.block_manager.block_size, bt_stride=meta.block_tables.stride(0),
                      m=self.m, mode=mode)
        self.params.copy_(torch.from_numpy(pack_params(values, self.d.rms_norm_eps)))

    def _launch(self, begin: int, end: int) -> None:
        self.kernel((self.sms,), (288,), (np.int32(begin), np.int32(end)), shared_mem=self.smem)

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: ``(logits [m, vocab] float32, final hidden [m, hidden])``."""
        from duetserve.model.triton_attention import paged_decode_attention
        d, m, meta = self.d, self.m, self.inputs.meta
        self.counter.zero_()
        self.stream[:m].copy_(self.model.model.embed_tokens(self.inputs.input_ids))
        stream = torch.cuda.current_stream().cuda_stream
        with self.cupy.cuda.ExternalStream(stream):
            self.cupy.cuda.runtime.memcpyAsync(self.symbol.ptr, self.params.data_ptr(), self.params.numel() * 8,
                                               self.cupy.cuda.runtime.memcpyDeviceToDevice, stream)
            begin = 0
            for layer in range(d.num_layers):
                self._launch(begin, layer * PHASES + 2)
                begin = layer * PHASES + 2
                paged_decode_attention(self.qrot[:m], *self.kv[layer], meta.block_tables, meta.context_lens,
                                       d.head_dim ** -0.5, out=self.attn[:m].view(m, d.num_heads, d.head_dim),
                                       counters=self.attn_counters)
            self._launch(begin, d.num_layers * PHASES)
        hidden = self.model.model.norm(self.stream[:m])[0]
        return self.model.compute_logits(hidden), hidden


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/decode_stream.json"))
    parser.add_argument("--variants", nargs="+", default=["tiled:9", "rows:9", "module"],
                        help="kernels LAYOUT:STAGES to check and time (tiled: stream-layout weight copies; rows: "
                             "the engine's own weights), or module (duetserve.model.decode_stream, the rows kernel "
                             "through the driver API); the first build is also profiled")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_stream.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # CuPy's ExternalStream
    from duetserve.calibrate.workload import QWEN3_8B, make_batch
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    kv_per_token = 36 * 2 * 8 * 128 * 2
    engine = LLMEngine(EngineConfig(model=str(folder), load_format="dummy", device="cuda", dtype="bfloat16",
                                    max_num_seqs=MR, max_num_batched_tokens=8192,
                                    num_kv_blocks=(24 << 30) // (16 * kv_per_token), max_model_len=16384,
                                    partition_backend="none"))
    for k, v in engine.runner.kv_caches:
        k.normal_()
        v.normal_()
    ds = BenchStream(engine)
    module = DecodeStream(engine.model, engine.runner.kv_caches) if "module" in args.variants else None
    graph_ms, events_ms = _weight_stream().graph_ms, _weight_stream().events_ms
    emb = engine.model.model.embed_tokens.weight
    wbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters() if p is not emb)
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    rows = []
    for batch, ctx in SHAPES:
        seqs = make_batch(engine, batch, ctx, 1)
        inputs = engine.runner._prepare(seqs, batch, [None] * batch)
        d, slots = engine.model.dims, inputs.meta.slot_mapping

        def new_kv(d=d, slots=slots):
            return torch.stack([torch.stack([c.view(-1, d.num_kv_heads, d.head_dim)[slots] for c in kv])
                                for kv in engine.runner.kv_caches]).float()

        def engine_step(inputs=inputs):
            return engine.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)

        def step(v, inputs=inputs):
            """(logits, hidden) of kernel variant v: the product module, or a bench build."""
            if v == "module":
                hidden = module.forward(inputs.input_ids, inputs.positions, inputs.meta)
                return engine.model.compute_logits(hidden), hidden
            ds.build(v)
            ds.set_inputs(inputs)
            return ds.run()
        with torch.no_grad():
            hidden_ref = engine.model(inputs.input_ids, inputs.positions, engine.runner.kv_caches, inputs.meta)
            logits_ref, kv_ref = engine.model.compute_logits(hidden_ref), new_kv()
            logits_graph = engine_step().clone()
            row = {"batch": batch, "ctx": ctx, "engine_graph_vs_eager_logits_rel_err": rel(logits_graph, logits_ref),
                   "checks": {}}
            for v in args.variants:
                logits, hidden = step(v)
                again, _ = step(v)
                row["checks"][v] = {
                    "hidden_rel_err": rel(hidden, hidden_ref), "new_kv_rel_err": rel(new_kv(), kv_ref),
                    "logits_rel_err": rel(logits, logits_ref),
                    "argmax_agree": float((logits.argmax(-1) == logits_ref.argmax(-1)).float().mean()),
                    "deterministic": bool(torch.equal(logits, again)), "nan": bool(hidden.float().isnan().any())}
            floor = (wbytes + batch * ctx * kv_per_token) / COPY_BW * 1e3
            row.update(floor_ms=floor, engine_ms=events_ms(engine_step), stream_ms={})
            for v in args.variants:
                row["stream_ms"][v] = graph_ms(lambda v=v: step(v))
            ds.build(next(v for v in args.variants if v != "module"))
            for mode, name in ((2, "stream_only_ms"), (1, "no_grid_wait_ms")):
                ds.set_inputs(inputs, mode)
                row[name] = graph_ms(ds.run)
            ds.set_inputs(inputs)
            ds.run()  # leave sane K/V in the new tokens' slots
        rows.append(row)
        print(row, flush=True)
        for s in seqs:
            engine.block_manager.free(s.seq)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"variants": args.variants, "rows": rows}, indent=1))
    print("\ndecode step to logits (no sampling), ms and ratio to the floor, per kernel LAYOUT:STAGES")
    print(f"{'shape':>8} {'floor':>7} {'engine graph':>14} " + " ".join(f"{v:>14}" for v in args.variants)
          + f" {'stream only':>11}  hidden err per kernel (engine graph vs eager logits)")
    for r in rows:
        f = r["floor_ms"]
        cols = " ".join(f"{ms:7.3f} x{ms / f:.3f}" for ms in r["stream_ms"].values())
        errs = " ".join(f"{c['hidden_rel_err']:.1e}" for c in r["checks"].values())
        print(f"{r['batch']:>3}x{r['ctx']:<5}{f:7.3f} {r['engine_ms']:7.3f} x{r['engine_ms'] / f:.3f} {cols} "
              f"{r['stream_only_ms']:11.3f}  {errs} ({r['engine_graph_vs_eager_logits_rel_err']:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
