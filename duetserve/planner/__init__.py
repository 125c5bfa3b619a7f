"""Planner: hardware profiles, the attention-aware roofline cost model, the per-iteration
partition optimizer and SGLang's PD-multiplexing rules (docs/design.md sections 3-5)."""

from duetserve.planner.cost_model import Breakdown, CostModel, ModelShape, Request
from duetserve.planner.hardware import (
    HardwareProfile,
    available_profiles,
    load_profile,
    saturating_points,
)
from duetserve.planner.optimizer import Plan, plan_iteration, trim_prefill
from duetserve.planner.pdmux import (
    PdmuxConfig,
    choose_group,
    prefill_layers_per_round,
    split_levels,
    stream_groups,
)

__all__ = [
    "Breakdown",
    "CostModel",
    "HardwareProfile",
    "ModelShape",
    "PdmuxConfig",
    "Plan",
    "Request",
    "available_profiles",
    "choose_group",
    "load_profile",
    "plan_iteration",
    "prefill_layers_per_round",
    "saturating_points",
    "split_levels",
    "stream_groups",
    "trim_prefill",
]
