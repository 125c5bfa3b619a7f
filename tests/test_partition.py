"""Partition backends: CPU-side logic here; the %smid self-tests run on a GPU (marker gpu)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from duetserve.partition import NoPartition, make_partition_backend
from duetserve.partition.tpcmask import build_native, disabled_words, mask_offset


def test_cpu_gets_no_partition():
    backend = make_partition_backend("auto", "cpu")
    assert isinstance(backend, NoPartition) and backend.granularity == 0
    with pytest.raises(ValueError):
        backend.pair(16)
    with pytest.raises(ValueError, match="--partition-backend"):
        make_partition_backend("mig", "cpu")


class _Loading(Exception):
    """Raised where the engine would start loading the model: the partition check passed."""


def _engine_with_backend(monkeypatch, name: str, backend) -> None:
    """Build an engine on ``cuda`` for ``--partition-backend name`` whose selection returns ``backend``."""
    import duetserve.engine.engine as engine_module
    from duetserve.config import EngineConfig

    def loading(*_, **__):
        raise _Loading

    monkeypatch.setattr(engine_module, "make_partition_backend", lambda *_: backend)
    monkeypatch.setattr(engine_module, "make_attention_backend", loading)
    engine_module.LLMEngine(EngineConfig(device="cuda", partition_backend=name))


class _GreenCtxFallback:
    name, fallback_reason = "greenctx", "tpcmask: self-test failed: level 32: decode used 40/32 SMs"


@pytest.mark.parametrize("name, backend, reason", [
    ("greenctx", NoPartition(132, "greenctx: self-test failed: level 8: decode used 16/8 SMs"),
     "greenctx: self-test failed: level 8: decode used 16/8 SMs"),
    ("tpcmask", _GreenCtxFallback(), "tpcmask: self-test failed: level 32: decode used 40/32 SMs"),
])
def test_engine_refuses_an_explicit_backend_that_fails_before_loading(monkeypatch, name, backend, reason):
    with pytest.raises(ValueError) as exc:
        _engine_with_backend(monkeypatch, name, backend)
    assert str(exc.value) == f"--partition-backend {name} does not work on cuda ({reason}); use auto or none"


def test_engine_auto_falls_back_quietly(monkeypatch):
    with pytest.raises(_Loading):
        _engine_with_backend(monkeypatch, "auto", NoPartition(132, "greenctx: self-test failed"))


def test_mask_offsets_by_driver_version():
    assert mask_offset(13000) == 0x51C
    assert mask_offset(12080) == 0x4FC and mask_offset(12070) == 0x4FC
    assert mask_offset(12000) == 0x4CC
    with pytest.raises(RuntimeError, match="13010"):
        mask_offset(13010)


def test_disabled_words_set_a_bit_per_excluded_tpc():
    # 66 TPCs, keep 0..7: bits 8..65 set -> word0 = 0xFFFFFF00, word1 = all, word2 = bits 64, 65.
    assert disabled_words(range(8), 66) == [0xFFFFFF00, 0xFFFFFFFF, 0x3, 0]
    # keep 8..65: only bits 0..7 set
    assert disabled_words(range(8, 66), 66) == [0xFF, 0, 0, 0]


def test_native_shim_writes_the_field_at_the_offset(tmp_path):
    """The shim follows handle -> object pointer -> field at offset, on a fake driver object."""
    lib = ctypes.CDLL(str(build_native(tmp_path)))
    obj = (ctypes.c_uint8 * 0x600)()
    handle_target = ctypes.c_void_p(ctypes.addressof(obj))          # what a CUstream points to
    handle = ctypes.c_void_p(ctypes.addressof(handle_target))
    words = (ctypes.c_uint32 * 4)(0xFFFFFF00, 0xFFFFFFFF, 0x3, 0)
    assert lib.duet_set_stream_tpc_mask(handle, ctypes.c_uint32(0x51C), words) == 0
    field = (ctypes.c_uint32 * 5).from_address(ctypes.addressof(obj) + 0x51C)
    assert list(field) == [1, 0xFFFFFF00, 0xFFFFFFFF, 0x3, 0]
    out = (ctypes.c_uint32 * 5)()
    assert lib.duet_get_stream_tpc_mask(handle, ctypes.c_uint32(0x51C), out) == 0 and list(out) == list(field)
    assert bytes(obj[:0x51C]) == bytes(0x51C)                       # nothing else touched
    assert lib.duet_set_stream_tpc_mask(None, ctypes.c_uint32(0x51C), words) == -1


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["greenctx", "tpcmask"])
def test_backend_self_test_on_gpu(name):
    backend = make_partition_backend(name, "cuda")
    assert backend.name == name, getattr(backend, "reason", "")
    pair = backend.pair(backend.levels()[0])
    assert pair.s_decode + pair.s_prefill == backend.num_sms


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["greenctx", "tpcmask"])
def test_graph_replays_on_the_sms_of_its_capture_stream(name):
    """The engine records decode graphs per split level on that level's decode stream; a
    replay there must stay on the level's SMs. Also prints where a graph captured on the
    smallest level runs when replayed on the largest (whether one graph set could serve every
    level)."""
    from duetserve.partition.probe import _smid_kernel, sms_used

    backend = make_partition_backend(name, "cuda")
    assert backend.name == name, getattr(backend, "reason", "")
    small, large = backend.pair(backend.levels()[0]).decode, backend.pair(backend.levels()[-1]).decode
    allowed_small, allowed_large = sms_used(small), sms_used(large)  # also compiles the probe
    out = torch.full((4096,), -1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=small):
        _smid_kernel[(out.numel(),)](out, 20000, num_warps=1)
    for stream in (small, large):
        out.fill_(-1)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        seen = set(out.tolist())
        if stream is small:
            assert seen <= allowed_small and len(seen) == len(allowed_small)
        else:
            print(f"{name}: graph captured on {len(allowed_small)} SMs, replayed on a {len(allowed_large)}-SM "
                  f"stream: ran on {len(seen)} SMs, {len(seen - allowed_large)} outside that stream's")
