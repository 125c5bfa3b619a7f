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


def test_split_decode_graphs_are_recorded_for_the_levels_a_policy_can_plan():
    """The engine records split decode graphs for pdmux's groups, every partition level for duet,
    none for the temporal policies (chunked, prefill-first) and none without partitioning."""
    from types import SimpleNamespace

    from duetserve.engine.engine import split_levels
    from duetserve.engine.policy import policy_by_name
    from duetserve.partition.base import NoPartition
    from duetserve.planner.policies import DuetPolicy

    planner = PlannerConfig(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")), 0.1, "greenctx")
    greenctx = SimpleNamespace(granularity=8, levels=lambda: [8, 16, 24])
    assert split_levels(PdmuxPolicy(planner), greenctx) == [20, 28, 36, 44, 52, 60]
    assert split_levels(DuetPolicy(planner), greenctx) == [8, 16, 24]
    assert split_levels(policy_by_name("chunked"), greenctx) == []
    assert split_levels(policy_by_name("prefill-first"), greenctx) == []
    assert split_levels(DuetPolicy(planner), NoPartition(132)) == []


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


def test_the_last_layers_are_delivered_when_their_tokens_land_not_waited_for(tiny_qwen3_folder, monkeypatch):
    """No round joins the prefill stream: after the last layer is queued, rounds run their
    decode step alone until the sampled tokens' copy has landed; then the batch is delivered."""
    from duetserve.engine import model_runner

    class Pending(model_runner._HostCopy):
        landed = True

        def ready(self) -> bool:
            return Pending.landed

    monkeypatch.setattr(model_runner, "_HostCopy", Pending)
    config = EngineConfig(model=str(tiny_qwen3_folder), max_num_batched_tokens=32, num_kv_blocks=128, block_size=8,
                          partition_backend="none")
    prompts, params = [[5, 6], list(range(3, 40))], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLMEngine(config).generate(prompts, params)
    engine = LLMEngine(config)
    shape = ModelShape.from_hf_config(json.loads((tiny_qwen3_folder / "config.json").read_text()))
    engine.scheduler.policy = PdmuxPolicy(PlannerConfig(shape, roofline_only(load_profile("h200")), 0.1, "greenctx",
                                                        PdmuxConfig(split_forward_token_budget=16)))
    out = {"0": [], "1": []}

    def step():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids

    engine.add_request("0", prompts[0], params)
    step()                                  # "0" prefilled: it decodes from now on
    engine.add_request("1", prompts[1], params)
    step()                                  # layer 1 of 2 of "1" beside a decode step of "0"
    Pending.landed = False
    step()                                  # layer 2 and the sampling queued; the tokens not yet landed
    assert engine.runner._split[3] == 2 and not engine.runner.prefill_done and out["1"] == []
    step()                                  # still in flight: "0" decodes alone, nothing re-run
    assert engine.runner._split[3] == 2 and not engine.runner.prefill_done and out["1"] == []
    assert len(out["0"]) == 4
    Pending.landed = True
    step()                                  # landed: "1" gets its first token
    assert engine.runner.prefill_done and engine.runner._split is None and len(out["1"]) == 1
    while engine.has_unfinished():
        step()
    assert [out["0"], out["1"]] == expected
