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


class _Event:
    """Stands in for the CUDA event recorded after a round's layers on the prefill stream."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_round_adds_no_layers_while_the_last_rounds_still_run(tiny_qwen3_folder):
    """No backlog on the prefill stream: while the previous round's layers are still running
    (its event not complete), a round runs its decode step alone and the split keeps its place."""
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=32, num_kv_blocks=128, block_size=8,
                          partition_backend="none")
    prompts, params = [[5, 6], list(range(3, 40))], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLMEngine(config).generate(prompts, params)
    engine = LLMEngine(config)
    shape = ModelShape.from_hf_config(json.loads((tiny_qwen3_folder / "config.json").read_text()))
    engine.scheduler.policy = PdmuxPolicy(PlannerConfig(shape, roofline_only(load_profile("h200")), 0.1, "greenctx",
                                                        PdmuxConfig(split_forward_token_budget=16)))
    out = {"0": [], "1": []}
    engine.add_request("0", prompts[0], params)
    for o in engine.step():                 # "0" prefilled: it decodes from now on
        out[o.request_id] += o.new_token_ids
    engine.add_request("1", prompts[1], params)
    for o in engine.step():                 # layer 1 of 2 of "1" beside a decode step of "0"
        out[o.request_id] += o.new_token_ids
    assert engine.runner._split[3] == 1 and not engine.runner.prefill_done
    engine.runner._split_busy = _Event(done=False)
    for o in engine.step():                 # layer 1 still running: decode alone, no layer added
        out[o.request_id] += o.new_token_ids
    assert engine.runner._split[3] == 1 and not engine.runner.prefill_done and len(out["0"]) == 3
    engine.runner._split_busy = _Event(done=True)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert [out["0"], out["1"]] == expected
