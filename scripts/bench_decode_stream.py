"""GPU experiment: a decode step as weight-stream kernels between the engine's decode attentions (issue 5).

``duetserve/model/csrc/decode_stream.cu`` runs everything of a Qwen3 decode step except attention,
lm_head and sampling: per layer o + residual, post-attention RMSNorm + gate_up + SiLU-and-mul, down
+ residual, the next layer's input RMSNorm + qkv and q/k-norm + RoPE + KV write, each phase after a
grid barrier, in ONE launch between two of the engine's Triton decode attentions (37 launches and
36 attentions a step, against nine kernels a layer in the engine's graphs). Inside a launch one
producer warp per SM streams the weights without stopping at phase boundaries
(``bench_weight_stream.py`` measures that part alone).

Kernel variants (``--variants``), each a ``duetserve.model.decode_stream.DecodeStream`` build:
``groups:STAGES`` reads the engine's own weights, 8 whole rows a stage as one contiguous bulk copy
(the build ``serve --decode-stream`` runs, 3 stages of 64 KB at Qwen3-8B's hidden size);
``tiled:STAGES`` reads copies of the weights in the stream layout
(``bench_weight_stream.stream_layout``, RMSNorm weights folded into qkv and gate_up: twice the
weight memory). Builds the engine with dummy Qwen3-8B weights (bf16, CUDA
graphs), then per shape (batch x context): checks each variant's final hidden states and the new
tokens' K/V against the engine's eager forward (bf16 rounding drifts over 36 layers: the engine's
own graphs and eager paths differ too, both are printed), and times one step (logits, no
sampling) in a CUDA graph against the engine's decode graph, with the floor
``bytes(weights + KV read) / 4.19 TB/s``; then each variant again in the kernel's test modes
(``MODES``: without grid waits, streaming and multiplying only, both, and the weight copies alone),
which place its time between the stream, the multiplies and the per-phase work.

Needs a CUDA GPU of compute capability 9.0 with nvcc and cuda-bindings (the lent H200's image has
both).
Writes JSON to ``--out``; prints a short table last. Exit code 2 without CUDA.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

from duetserve.model.decode_stream import LAYOUTS, DecodeStream, kernel_defines
from duetserve.model.layers import graph_kernels

HERE = Path(__file__).resolve().parent
COPY_BW = 4.19e12
SHAPES = ((8, 512), (8, 2048), (8, 8192), (1, 512), (4, 2048))


@functools.cache
def _weight_stream():
    spec = importlib.util.spec_from_file_location("bench_weight_stream", HERE / "bench_weight_stream.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiled_weights(model) -> dict[str, torch.Tensor]:
    """The ``tiled`` kernels' weights: ``[L, N, K]`` copies in ``bench_weight_stream.stream_layout``
    (RMSNorm weights folded into qkv and gate_up, gate/up interleaved) and the q/k norms ``[L, D]``,
    by ``FIELDS`` name."""
    ws, layers, n = _weight_stream(), model.model.layers, model.dims.intermediate_size

    def stack(fn):
        return torch.stack([fn(layer) for layer in layers])

    def fold(w, g):
        return (w.float() * g.float()[None, :]).to(torch.bfloat16)
    with torch.no_grad():
        gu = stack(lambda ly: fold(ly.mlp.gate_up_proj.weight, ly.post_attention_layernorm.weight))
        weights = {"wqkv": ws.stream_layout(stack(lambda ly: fold(ly.self_attn.qkv_proj.weight,
                                                                      ly.input_layernorm.weight))),
                   "wo": ws.stream_layout(stack(lambda ly: ly.self_attn.o_proj.weight)),
                   "wgu": ws.stream_layout(ws.interleave_gate_up(gu[:, :n], gu[:, n:])),
                   "wdown": ws.stream_layout(stack(lambda ly: ly.mlp.down_proj.weight)),
                   "qnorm": stack(lambda ly: ly.self_attn.q_norm.weight).contiguous(),
                   "knorm": stack(lambda ly: ly.self_attn.k_norm.weight).contiguous()}
    del gu
    torch.cuda.empty_cache()
    return weights


# The kernel's mode bits (decode_stream.cu, Params.mode) timed per variant, by result key
MODES = {1: "no_grid_wait_ms", 2: "stream_only_ms", 3: "stream_only_no_wait_ms", 7: "copies_only_no_wait_ms"}


def make_variant(engine, variant: str, tiled: dict[str, torch.Tensor]) -> DecodeStream:
    """``LAYOUT:STAGES[:KC]`` (``decode_stream.LAYOUTS``): ``groups`` reads the engine's own weights,
    ``tiled`` the stream-layout copies ``tiled``."""
    layout, stages, *kc = variant.split(":")
    if layout not in LAYOUTS:
        raise ValueError(f"--variants {variant}: the layout must be one of {', '.join(LAYOUTS)}")
    defines = kernel_defines(engine.model, int(stages), layout)
    ds = DecodeStream(engine.model, engine.runner.kv_caches, defines={**defines, "KC": int(kc[0])} if kc else defines)
    if layout == "tiled":
        ds.extra_params.update({name: t.data_ptr() for name, t in tiled.items()})
    return ds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/decode_stream.json"))
    parser.add_argument("--variants", nargs="+", default=["groups:3", "tiled:9"],
                        help="kernels LAYOUT:STAGES to check and time (groups: the engine's own weights, 8 whole rows "
                             "a stage, as serve --decode-stream runs them; tiled: stream-layout weight copies)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_stream.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from duetserve.calibrate.workload import QWEN3_8B, make_batch
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    kv_per_token = 36 * 2 * 8 * 128 * 2
    engine = LLMEngine(EngineConfig(model=str(folder), load_format="dummy", device="cuda", dtype="bfloat16",
                                    max_num_seqs=8, max_num_batched_tokens=8192,
                                    num_kv_blocks=(24 << 30) // (16 * kv_per_token), max_model_len=16384,
                                    partition_backend="none"))
    for k, v in engine.runner.kv_caches:
        k.normal_()
        v.normal_()
    tiled = tiled_weights(engine.model) if any(v.startswith("tiled") for v in args.variants) else {}
    kernels = {v: make_variant(engine, v, tiled) for v in args.variants}
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
            """(logits, hidden) of kernel variant ``v``."""
            hidden = kernels[v].forward(inputs.input_ids, inputs.positions, inputs.meta)
            return engine.model.compute_logits(hidden), hidden
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
            # the engine's graph replayed alone (its inputs staged once, above), as the stream's graph is;
            # engine_run_ms adds the input copies graphs.run makes before each replay
            row.update(floor_ms=floor, engine_ms=events_ms(engine.graphs.graphs[engine.graphs.bucket(batch)].replay),
                       engine_run_ms=events_ms(engine_step), stream_ms={}, stream_in_engine_ms={},
                       **{name: {} for name in MODES.values()})
            for v in args.variants:
                row["stream_ms"][v] = graph_ms(lambda v=v: step(v))
                with graph_kernels():  # recorded as the engine records its decode graphs (PDL attention)
                    row["stream_in_engine_ms"][v] = graph_ms(lambda v=v: step(v))
                for mode, name in MODES.items():
                    kernels[v].extra_params["mode"] = mode
                    row[name][v] = graph_ms(lambda v=v: step(v))
                kernels[v].extra_params.pop("mode")
                step(v)  # leave sane K/V in the new tokens' slots
        rows.append(row)
        print(row, flush=True)
        for s in seqs:
            engine.block_manager.free(s.seq)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"variants": args.variants, "rows": rows}, indent=1))
    print("\ndecode step to logits (no sampling), ms and ratio to the floor, per kernel LAYOUT:STAGES")
    print(f"{'shape':>8} {'floor':>7} {'engine graph':>14} " + " ".join(f"{v:>14}" for v in args.variants)
          + "  hidden err per kernel (engine graph vs eager logits)")
    for r in rows:
        f = r["floor_ms"]
        cols = " ".join(f"{ms:7.3f} x{ms / f:.3f}" for ms in r["stream_ms"].values())
        errs = " ".join(f"{c['hidden_rel_err']:.1e}" for c in r["checks"].values())
        print(f"{r['batch']:>3}x{r['ctx']:<5}{f:7.3f} {r['engine_ms']:7.3f} x{r['engine_ms'] / f:.3f} {cols} "
              f" {errs} ({r['engine_graph_vs_eager_logits_rel_err']:.1e})")
    print("\nms: the engine's graphs.run (input copies, then the replay); per kernel, recorded inside graph_kernels "
          "as the engine records it (PDL attention)")
    for r in rows:
        print(f"{r['batch']:>3}x{r['ctx']:<5} {r['engine_run_ms']:7.3f} " + " ".join(
            f"{v} {ms:7.3f}" for v, ms in r["stream_in_engine_ms"].items()))
    print("\nper kernel, ms: no grid waits (wrong values) / stream and mma only / both / the copies alone, no waits")
    for r in rows:
        print(f"{r['batch']:>3}x{r['ctx']:<5}" + "".join(
            f"  {v} " + " / ".join(f"{r[name][v]:.3f}" for name in MODES.values()) for v in args.variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
