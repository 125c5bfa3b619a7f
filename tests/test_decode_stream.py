"""duetserve.model.decode_stream on the CPU: the shapes it takes, its parameter block against the
kernel's struct, and its kernel build (where nvcc is installed); on the GPU, its decode step
against the model's own forward."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import CUDA

from duetserve.model import decode_stream as ds


def _model(**dims):
    base = {"head_dim": 128, "hidden_size": 1024, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 3072, "qk_norm": True,
                "attention_bias": False, "mlp_bias": False}
    return SimpleNamespace(dims=SimpleNamespace(**{**base, **dims}))


def test_importing_it_leaves_triton_unimported():
    """Triton's interpreter is chosen when triton is first imported (conftest.import_triton_module):
    a module that imports it at import time makes the Triton test files skip themselves."""
    code = "import sys, duetserve.model.decode_stream; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_params_fields_follow_the_kernels_struct_in_order():
    body = ds.SOURCE.read_text()
    body = body[body.index("struct Params {"):body.index("};", body.index("struct Params {"))]
    names = re.findall(r"^\s+[\w ]+?\**\s*(\w+);", body, flags=re.MULTILINE)
    assert tuple(names[:-2]) == ds.FIELDS and names[-2:] == ["eps", "unused"]


def test_pack_params_fills_missing_fields_with_zero_and_eps_last():
    packed = ds.pack_params({"wtab": 7, "m": 3}, 1e-6)
    assert packed.dtype == np.int64 and len(packed) == len(ds.FIELDS) + 1
    assert packed[ds.FIELDS.index("wtab")] == 7 and packed[ds.FIELDS.index("m")] == 3
    assert packed[:-1].sum() == 10 and packed[-1:].view(np.float32).tolist() == [np.float32(1e-6), 0.0]
    ordered = ds.pack_params({name: i + 1 for i, name in enumerate(ds.FIELDS)}, 0.5)
    assert ordered[:-1].tolist() == list(range(1, len(ds.FIELDS) + 1))


def test_extra_params_reach_the_parameter_block_and_its_cache_key():
    """``DecodeStream.extra_params`` (a benchmark's mode bits or tiled weights) lands in the block
    and gives it its own cache entry (a graph keeps the block it recorded)."""
    stream = ds.DecodeStream.__new__(ds.DecodeStream)
    cache = torch.zeros(1, 2, 4, 16, 2, 128)  # [layers, K/V, blocks, block size, KV heads, head dim]
    stream.model = SimpleNamespace(rotary=SimpleNamespace(cos=torch.zeros(1), sin=torch.zeros(1)))
    stream.d = SimpleNamespace(rms_norm_eps=1e-6)
    stream.kv, stream.kv_stride, stream.layer_stride = [(cache[0, 0], cache[0, 1])], 4 * 16 * 2 * 128, 0
    for name in ("stream", "qkv", "attn", "h", "down", "qrot", "counter", "gcount", "wtab"):
        setattr(stream, name, torch.zeros(1))
    stream.params, stream.extra_params = {}, {}
    meta = SimpleNamespace(slot_mapping=torch.zeros(3, dtype=torch.int64), block_tables=torch.zeros(3, 5),
                           context_lens=torch.zeros(3, dtype=torch.int32))
    positions = torch.zeros(3, dtype=torch.int64)
    plain = stream._params(positions, meta)
    stream.extra_params["mode"] = 2
    moded = stream._params(positions, meta)
    assert len(stream.params) == 2 and moded is not plain
    at = ds.FIELDS.index
    assert (plain[at("mode")], moded[at("mode")], moded[at("m")], moded[at("bt_stride")]) == (0, 2, 3, 5)
    assert moded[at("block_size")] == 16 and stream._params(positions, meta) is moded


def test_kernel_defines_take_qwen3_shapes_only():
    # groups: 8 rows x 1024 columns x 2 bytes = 16 KB a stage, 196608 / 16384 = 12 stages
    assert ds.kernel_defines(_model()) == {"HID": 1024, "INTER": 3072, "HQ": 8, "HKV": 2, "HD": 128, "KPART": 1024,
                                           "NSTAGE": 12, "OWN_WEIGHTS": 1, "KC": 512}
    assert ds.kernel_defines(_model(hidden_size=4096, num_heads=32, intermediate_size=12288))["NSTAGE"] == 3  # Qwen3-8B: 64 KB
    assert ds.kernel_defines(_model(), 5)["NSTAGE"] == 5
    assert ds.kernel_defines(_model(hidden_size=512, num_heads=4))["NSTAGE"] == 24
    assert ds.kernel_defines(_model(), layout="tiled") == {**ds.kernel_defines(_model()), "NSTAGE": 9, "OWN_WEIGHTS": 0}
    with pytest.raises(ValueError, match="layout must be one of groups, tiled, got 'rows'"):
        ds.kernel_defines(_model(), layout="rows")
    for bad in ({"head_dim": 64, "num_heads": 8}, {"hidden_size": 640, "num_heads": 5}, {"intermediate_size": 1000},
                {"qk_norm": False}, {"mlp_bias": True}, {"hidden_size": 5120, "num_heads": 40}):
        with pytest.raises(ValueError, match="Qwen3-like shapes"):
            ds.kernel_defines(_model(**bad))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_builds_for_sm90a_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DUETSERVE_CACHE", str(tmp_path))
    first = ds.build_cubin(ds.kernel_defines(_model()))
    assert first.parent == tmp_path / "kernels" and first.read_bytes()[:4] == b"\x7fELF"
    stamp = first.stat().st_mtime_ns
    assert ds.build_cubin(ds.kernel_defines(_model())) == first and first.stat().st_mtime_ns == stamp
    assert ds.build_cubin({**ds.kernel_defines(_model()), "NSTAGE": 3}) != first  # other flags, other file
    assert ds.build_cubin(ds.kernel_defines(_model(), layout="tiled")).exists()  # the tiled build compiles too


def test_build_names_the_missing_compiler(monkeypatch):
    monkeypatch.setattr(ds.shutil, "which", lambda name: None)
    monkeypatch.setattr(ds.Path, "exists", lambda self: False)
    with pytest.raises(RuntimeError, match="needs nvcc"):
        ds.build_cubin(ds.kernel_defines(_model()))


SMALL_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
               "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
               "head_dim": 128, "vocab_size": 320, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_decode_step_matches_the_models_forward(tmp_path):
    """On a 2-layer Qwen3 of the kernel's shapes (hidden 1024, dummy bf16 weights) the stream's
    hidden states and new K/V match the model's own decode step within bf16 rounding."""
    pytest.importorskip("cuda.bindings")
    if torch.cuda.get_device_capability()[0] != 9 or shutil.which("nvcc") is None:
        pytest.skip("needs an sm_90 GPU and nvcc")
    import json

    from duetserve.calibrate.workload import make_batch
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(SMALL_QWEN3))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cuda", dtype="bfloat16",
                                    max_num_seqs=8, num_kv_blocks=256, enforce_eager=True, partition_backend="none"))
    for k, v in engine.runner.kv_caches:
        k.normal_()
        v.normal_()
    seqs = make_batch(engine, 5, 300, 1)
    inputs = engine.runner._prepare(seqs, 5, [None] * 5)
    stream = ds.DecodeStream(engine.model, engine.runner.kv_caches)
    slots = inputs.meta.slot_mapping

    def new_kv():
        return torch.stack([torch.stack([c.reshape(-1, 2, 128)[slots] for c in kv])
                            for kv in engine.runner.kv_caches]).float()
    with torch.no_grad():
        ref = engine.model(inputs.input_ids, inputs.positions, engine.runner.kv_caches, inputs.meta).float()
        ref_kv = new_kv()
        for kv in engine.runner.kv_caches:  # the new tokens' slots cleared: the stream must write them itself
            for c in kv:
                c.view(-1, 2, 128)[slots] = 0
        got = stream.forward(inputs.input_ids, inputs.positions, inputs.meta).float()
        got_kv = new_kv()
    assert not got.isnan().any() and float((got - ref).norm() / ref.norm()) < 2e-2
    assert float((got_kv - ref_kv).norm() / ref_kv.norm()) < 2e-2


def test_config_refuses_the_decode_stream_without_cuda_graphs(tiny_qwen3_folder):
    from duetserve.config import EngineConfig

    # refused by the config, before the model loads
    with pytest.raises(ValueError, match="^--decode-stream needs decode CUDA graphs: a CUDA device and no "):
        EngineConfig(model=str(tiny_qwen3_folder), num_kv_blocks=64, decode_stream=True)
    with pytest.raises(ValueError, match="^--decode-stream needs decode CUDA graphs"):
        EngineConfig(device="cuda", enforce_eager=True, decode_stream=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_engine_decode_graphs_through_the_stream_match_the_model(tmp_path):
    """``--decode-stream``: the decode graphs of up to 8 sequences run the stream kernels; their
    logits match the model's own forward within bf16 rounding, and larger batches keep the
    model's layers."""
    pytest.importorskip("cuda.bindings")
    if torch.cuda.get_device_capability()[0] != 9 or shutil.which("nvcc") is None:
        pytest.skip("needs an sm_90 GPU and nvcc")
    import json

    from duetserve.calibrate.workload import make_batch
    from duetserve.config import EngineConfig
    from duetserve.engine.engine import LLMEngine

    (tmp_path / "config.json").write_text(json.dumps(SMALL_QWEN3))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cuda", dtype="bfloat16",
                                    max_num_seqs=16, num_kv_blocks=512, partition_backend="none", decode_stream=True))
    assert engine.graphs.decode_stream is not None
    for k, v in engine.runner.kv_caches:
        k.normal_()
        v.normal_()
    for batch in (3, 8, 12):  # 12: the 16-row graph, the model's own layers
        seqs = make_batch(engine, batch, 200, 1)
        inputs = engine.runner._prepare(seqs, batch, [None] * batch)
        with torch.no_grad():
            ref = engine.model.compute_logits(
                engine.model(inputs.input_ids, inputs.positions, engine.runner.kv_caches, inputs.meta))
            got = engine.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        assert not got.isnan().any() and float((got - ref).norm() / ref.norm()) < 2e-2, batch
        for s in seqs:
            engine.block_manager.free(s.seq)


def test_decode_graphs_route_small_buckets_through_the_stream():
    """``DecodeGraphs._step`` (what each graph records): buckets of up to ``MAX_ROWS`` sequences
    run the decode stream (final-normed hidden states, then the model's logits), larger ones the
    model's own layers; both get the graph's static inputs."""
    from duetserve.engine.cuda_graphs import DecodeGraphs

    calls = []

    class Model:
        def __call__(self, ids, positions, kv, meta):
            calls.append(("model", ids.shape[0], meta.num_decodes))
            return torch.zeros(ids.shape[0], 4)

        def compute_logits(self, hidden, out):
            return out.copy_(hidden + 1)

    class Stream:
        MAX_ROWS = 8

        def forward(self, ids, positions, meta):
            calls.append(("stream", ids.shape[0], meta.num_decodes))
            return torch.full((ids.shape[0], 4), 2.0)

    logits = torch.zeros(16, 4)
    graphs = DecodeGraphs(Model(), None, 16, 4, 0, torch.device("cpu"), decode_stream=Stream(), logits=logits)
    assert graphs.buckets == [1, 2, 4, 8, 16]
    assert graphs._step(8).tolist() == [[3.0] * 4] * 8
    assert logits.tolist() == [[3.0] * 4] * 8 + [[0.0] * 4] * 8  # written into the buffer given
    assert graphs._step(16).shape == (16, 4)
    assert calls == [("stream", 8, 8), ("model", 16, 16)]
    other = DecodeGraphs(Model(), None, 16, 4, 0, torch.device("cpu"), logits=logits)
    out = other._step(2)
    assert out.tolist() == [[1.0] * 4] * 2 and out.data_ptr() == logits.data_ptr()  # sets share one buffer
    with pytest.raises(ValueError, match=r"contiguous \[>= 16, vocab\]"):
        DecodeGraphs(Model(), None, 16, 4, 0, torch.device("cpu"), logits=logits[:8])
