"""On a CUDA GPU: spatial plans on SM-partitioned streams give the tokens of temporal plans (marker gpu)."""
from __future__ import annotations

import pytest
import torch
from conftest import run_counting_split_rounds

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
        self.observed: list[float] = []  # measured seconds per decode step, one per spatial iteration

    def plan(self, decode_reqs, prefill_reqs, max_k):
        return self.spatial if decode_reqs else Plan()

    def observe(self, plan, decode_step_s, prefill_s, idle_tail_s=None):
        self.observed.append(decode_step_s)


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
    assert set(engine.runner.last_stream_seconds) == {"decode", "prefill", "tail"}
    stats = engine.last_stats  # the iteration log's per-stream busy times, and the decodes' wait after theirs
    assert stats.stream_s == engine.runner.last_stream_seconds
    assert min(stats.stream_s["decode"], stats.stream_s["prefill"]) > 0 and stats.stream_s["tail"] >= 0
    policy = engine.scheduler.policy  # fed each spatial iteration's measured decode step
    assert policy.observed and min(policy.observed) > 0
    assert policy.observed[-1] == pytest.approx(stats.stream_s["decode"] / stats.decode_steps)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_pdmux_layer_split_on_green_contexts_gives_chunked_tokens(tiny_qwen3_folder, enforce_eager):
    """``--policy pdmux`` on the GPU: prefill cut into layer rounds on its green-context stream
    beside one decode step per round on the group's decode SMs (decode graphs recorded per
    group level unless eager): the tokens of chunked prefill."""
    import dataclasses
    import json

    from duetserve.planner.cost_model import ModelShape
    from duetserve.planner.hardware import load_profile
    from duetserve.planner.pdmux import PdmuxConfig
    from duetserve.planner.policies import PdmuxPolicy, PlannerConfig

    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (6, 30, 57, 80, 120)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_qwen3_folder), device="cuda", dtype="float32", max_num_batched_tokens=64,
                          num_kv_blocks=256, block_size=16, max_num_seqs=8, enforce_eager=enforce_eager)
    expected = LLMEngine(config).generate(prompts, params)

    engine = LLMEngine(dataclasses.replace(config, policy="pdmux", partition_backend="greenctx"))
    assert engine.partition.name == "greenctx", getattr(engine.partition, "reason", "")
    shape = ModelShape.from_hf_config(json.loads((tiny_qwen3_folder / "config.json").read_text()))
    planner = PlannerConfig(shape, load_profile("h200"), 0.1, "greenctx", PdmuxConfig(split_forward_token_budget=64),
                            cuda_graphs=not enforce_eager)
    engine.scheduler.policy = PdmuxPolicy(planner)  # 64 tokens a round: one layer per round
    outputs, unfinished = run_counting_split_rounds(engine, prompts, params)
    assert outputs == expected
    assert unfinished > 0
    assert engine.block_manager.num_free_blocks == 256
