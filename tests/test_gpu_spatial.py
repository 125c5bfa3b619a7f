"""On a CUDA GPU: spatial plans on SM-partitioned streams give the tokens of temporal plans (marker gpu)."""
from __future__ import annotations

import pytest
import torch

from duetserve.config import EngineConfig
from duetserve.engine.engine import LLMEngine
from duetserve.engine.policy import Plan
from duetserve.partition import make_partition_backend
from duetserve.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class ForcedSpatial:
    """Every iteration with a decode runs spatially: decode on ``s_decode`` SMs for ``k`` steps."""

    name, chunked_prefill, prefill_excludes_decode = "forced-spatial", True, False

    def __init__(self, s_decode: int, num_sms: int, k: int):
        self.spatial = Plan(spatial=True, s_prefill=num_sms - s_decode, s_decode=s_decode, k=k)

    def plan(self, decode_reqs, prefill_reqs, max_k):
        return self.spatial if decode_reqs else Plan()


@pytest.mark.parametrize("backend_name", ["greenctx", "tpcmask"])
def test_spatial_tokens_equal_temporal(tiny_qwen3_folder, backend_name):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 33, 64, 100, 150)]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)] * 2 + \
             [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)]
    config = EngineConfig(model=str(tiny_qwen3_folder), device="cuda", dtype="float32", max_num_batched_tokens=48,
                          num_kv_blocks=256, block_size=16, max_num_seqs=8, enforce_eager=True)
    expected = LLMEngine(config).generate(prompts, params)

    engine = LLMEngine(config)
    backend = make_partition_backend(backend_name, "cuda")
    assert backend.name == backend_name, getattr(backend, "reason", "")
    engine.runner.partition = backend
    engine.scheduler.policy = ForcedSpatial(backend.levels()[0], backend.num_sms, k=4)
    assert engine.generate(prompts, params) == expected
    assert set(engine.runner.last_stream_seconds) == {"decode", "prefill"}
