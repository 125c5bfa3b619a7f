"""Scheduling policies: how one iteration shares the GPU between prefill and decode.

The scheduler (``duetserve.engine.scheduler``) forms the candidate batch; a policy decides
whether prefill chunks may be split, whether prefill excludes decode, and which plan the
iteration runs (temporal, or spatial ``(S_p, S_d, k)``). The same policies drive the engine
and the simulator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Plan:
    """How one iteration runs.

    Attributes:
        spatial: False: one mixed batch on all SMs (temporal sharing). True: decode on
            ``s_decode`` SMs for ``k`` look-ahead steps while prefill runs on ``s_prefill`` SMs.
        s_prefill: SMs for the prefill stream (spatial plans).
        s_decode: SMs for the decode stream (spatial plans).
        k: decode steps in the iteration (>= 1).
        predicted_s: predicted iteration time, seconds (None when not predicted).
        predicted_decode_s: predicted time of one decode step, seconds.
        predicted_prefill_s: predicted time of the prefill batch, seconds.
        prefill_token_limit: most prefill tokens the iteration may hold (None: no limit); the
            scheduler trims prefill chunks to it.
        slo_risk: no plan was predicted to meet the TBT SLO.
        prefill_layers: for layer-split prefill (pdmux): layers per round; None runs all layers.
    """

    spatial: bool = False
    s_prefill: int = 0
    s_decode: int = 0
    k: int = 1
    predicted_s: float | None = None
    predicted_decode_s: float | None = None
    predicted_prefill_s: float | None = None
    prefill_token_limit: int | None = None
    slo_risk: bool = False
    prefill_layers: int | None = None


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


@dataclass
class ChunkedPolicy:
    """vLLM / Sarathi-Serve: decode first, then prefill chunks up to the token budget."""

    name: str = "chunked"
    chunked_prefill: bool = True
    prefill_excludes_decode: bool = False

    def plan(self, decode_reqs: list[tuple[int, int]], prefill_reqs: list[tuple[int, int]], max_k: int) -> Plan:
        return TEMPORAL


@dataclass
class PrefillFirstPolicy(ChunkedPolicy):
    """SGLang's default / vLLM without chunking: waiting prompts run whole, alone, first."""

    name: str = "prefill-first"
    chunked_prefill: bool = False
    prefill_excludes_decode: bool = True


def make_policy(config) -> Policy:
    """The policy named by ``config.policy`` (an ``EngineConfig``).

    Raises:
        ValueError: unknown policy name.
    """
    if config.policy == "chunked":
        return ChunkedPolicy()
    if config.policy == "prefill-first":
        return PrefillFirstPolicy()
    if config.policy == "duet":
        # Until the planner is wired in, duet plans are temporal: it behaves as chunked.
        return ChunkedPolicy(name="duet")
    raise ValueError(f"--policy {config.policy} is not available in the engine yet")
