"""pdmux's layer-split prefill in the engine: the same tokens as chunked, over several rounds."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import run_counting_split_rounds

from duetserve.config import EngineConfig
from duetserve.engine.engine import LLMEngine
from duetserve.planner.cost_model import ModelShape
from duetserve.planner.hardware import load_profile, roofline_only
from duetserve.planner.pdmux import PdmuxConfig
from duetserve.planner.policies import PdmuxPolicy, PlannerConfig
from duetserve.sampling import SamplingParams


@pytest.mark.parametrize("budget", [64, 1024])
def test_layer_split_prefill_gives_chunked_tokens(tiny_qwen3_folder, budget):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (6, 30, 57, 80)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=32, num_kv_blocks=128, block_size=8,
                          partition_backend="none")
    expected = LLMEngine(config).generate(prompts, params)

    engine = LLMEngine(config)
    shape = ModelShape.from_hf_config(json.loads((tiny_qwen3_folder / "config.json").read_text()))
    # A token budget of 64 cuts each prompt batch into 1 layer per round (2 rounds for 2
    # layers); 1024 runs both layers in one round.
    planner = PlannerConfig(shape, roofline_only(load_profile("h200")), 0.1, "greenctx",
                            PdmuxConfig(split_forward_token_budget=budget))
    engine.scheduler.policy = PdmuxPolicy(planner)
    outputs, unfinished = run_counting_split_rounds(engine, prompts, params)
    assert outputs == expected
    assert (unfinished > 0) == (budget == 64)
    assert engine.block_manager.num_free_blocks == 128


def test_pdmux_decode_levels_are_sglangs_split_groups():
    planner = PlannerConfig(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")), 0.1, "greenctx")
    # The seed's H100-style groups on 132 SMs: decode gets 20, 28, 36, 44, 52, 60.
    assert PdmuxPolicy(planner).decode_levels() == [20, 28, 36, 44, 52, 60]


def test_aborted_layer_split_batch_releases_its_state(tiny_qwen3_folder):
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=32, num_kv_blocks=128, block_size=8,
                          partition_backend="none")
    engine = LLMEngine(config)
    shape = ModelShape.from_hf_config(json.loads((tiny_qwen3_folder / "config.json").read_text()))
    engine.scheduler.policy = PdmuxPolicy(PlannerConfig(shape, roofline_only(load_profile("h200")), 0.1, "greenctx",
                                                        PdmuxConfig(split_forward_token_budget=16)))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("b", [5, 6], params)
    engine.step()                           # "b" prefilled: it decodes from now on
    engine.add_request("a", list(range(3, 40)), params)
    engine.step()
    assert engine.runner._split is not None and not engine.runner.prefill_done  # 1 of 2 layers done
    engine.abort("a")
    while engine.has_unfinished():          # decode-only rounds: the aborted batch's state is dropped
        engine.step()
    assert engine.runner._split is None and engine.block_manager.num_free_blocks == 128
