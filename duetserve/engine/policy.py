"""Scheduling policies: how one iteration shares the GPU between prefill and decode.

The scheduler (``duetserve.engine.scheduler``) forms the candidate batch; a policy decides
whether prefill chunks may be split, whether prefill excludes decode, and which plan the
iteration runs (temporal, or spatial ``(S_p, S_d, k)``). The same policies drive the engine
and the simulator.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from duetserve.planner.cost_model import ModelShape
from duetserve.planner.hardware import load_profile
from duetserve.planner.optimizer import Plan
from duetserve.planner.policies import DuetPolicy, PdmuxPolicy, PlannerConfig

TEMPORAL = Plan()


class Policy(Protocol):
    """What a scheduling policy tells the scheduler.

    Attributes:
        name: the ``--policy`` value.
        chunked_prefill: prompts may be split into chunks that fit the token budget; if False
            a prompt runs whole (the first prefill of a batch may exceed the budget).
        prefill_excludes_decode: a batch holding prefill holds no decode (prefill-first).
    """

    name: str
    chunked_prefill: bool
    prefill_excludes_decode: bool

    def plan(self, decode_reqs: list[tuple[int, int]], prefill_reqs: list[tuple[int, int]], max_k: int) -> Plan:
        """Choose the plan for a candidate batch.

        Args:
            decode_reqs: ``(q, c)`` per decode request: q = 1 query token, c cached tokens.
            prefill_reqs: ``(q, c)`` per prefill chunk: q query tokens, c cached tokens.
            max_k: most look-ahead decode steps any decode request can still use.
        """
        ...

    def observe(self, plan: Plan, decode_step_s: float, prefill_s: float | None,
                idle_tail_s: float | None = None) -> None:
        """Measured seconds per decode step of a spatial ``plan`` that ran, of its prefill stream
        (None: it had no prefill), and that the decodes then waited for the prefill's end after
        their last step (``idle_tail_s``, >= 0; None: not measured) (GPU only)."""
        ...

    def observe_iteration(self, plan: Plan, measured_s: float) -> None:
        """Measured wall seconds of a temporal iteration with decodes and prefill that ran ``plan``."""
        ...


@dataclass
class ChunkedPolicy:
    """vLLM / Sarathi-Serve: decode first, then prefill chunks up to the token budget."""

    name: str = "chunked"
    chunked_prefill: bool = True
    prefill_excludes_decode: bool = False

    def plan(self, decode_reqs: list[tuple[int, int]], prefill_reqs: list[tuple[int, int]], max_k: int) -> Plan:
        return TEMPORAL

    def observe(self, plan: Plan, decode_step_s: float, prefill_s: float | None,
                idle_tail_s: float | None = None) -> None:
        """No feedback: nothing is predicted."""

    def observe_iteration(self, plan: Plan, measured_s: float) -> None:
        """No feedback: nothing is predicted."""

    def decode_levels(self) -> list[int]:
        """Decode SM counts the engine records split decode graphs for: none, every plan is
        temporal (each level's set took the H200 about 1 s of start-up)."""
        return []


@dataclass
class PrefillFirstPolicy(ChunkedPolicy):
    """SGLang's default / vLLM without chunking: waiting prompts run whole, alone, first."""

    name: str = "prefill-first"
    chunked_prefill: bool = False
    prefill_excludes_decode: bool = True


def policy_by_name(name: str, planner: PlannerConfig | None = None) -> Policy:
    """The policy called ``name`` (a ``--policy`` value); ``duet`` and ``pdmux`` are built from
    ``planner`` (``duetserve.planner.policies``).

    Raises:
        ValueError: unknown name, ``duet``/``pdmux`` without ``planner``, or ``pdmux`` without a
            partition backend.
    """
    if name == "chunked":
        return ChunkedPolicy()
    if name == "prefill-first":
        return PrefillFirstPolicy()
    if name not in ("duet", "pdmux"):
        raise ValueError(f"unknown --policy {name!r}")
    if planner is None:
        raise ValueError(f"--policy {name} needs the model shape, GPU profile and TBT SLO")
    return DuetPolicy(planner) if name == "duet" else PdmuxPolicy(planner)


def make_policy(config, model_config: Mapping[str, object] | None = None) -> Policy:
    """The policy named by ``config.policy`` (an ``EngineConfig``).

    ``duet`` and ``pdmux`` plan with the cost model of the served model (``model_config``, its
    Hugging Face ``config.json`` dict; None reads the one of ``config.model``) on the GPU
    profile ``config.hardware_profile``, under ``config.tbt_slo_s`` and with
    ``config.partition_backend``. On a backend ``none`` (CPU) duet plans temporal batches and
    trims prefill when the prediction exceeds the SLO.

    Raises:
        ValueError: see ``policy_by_name``; a bad profile or model config.
        FileNotFoundError: ``config.model`` has no config to read.
    """
    planner = None
    if config.policy in ("duet", "pdmux"):
        shape = ModelShape.from_hf_config(model_config or _read_model_config(config.model))
        planner = PlannerConfig(shape, load_profile(config.hardware_profile), config.tbt_slo_s,
                                config.partition_backend, cuda_graphs=not config.enforce_eager,
                                trim_margin=config.trim_margin, piecewise_tokens=config.piecewise_tokens)
    return policy_by_name(config.policy, planner)


def _read_model_config(model: str | None) -> dict[str, object]:
    """The ``config.json`` of ``--model`` (a folder, a GGUF file's cached conversion, or the
    embedded model)."""
    from duetserve.model.loader import resolve_model

    folder, _ = resolve_model(model)
    return json.loads((folder / "config.json").read_text())
