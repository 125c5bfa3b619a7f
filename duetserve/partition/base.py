"""The partition-backend interface, the ``none`` backend, and backend selection with fallback."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

BACKENDS = ("greenctx", "tpcmask", "none")


@dataclass
class StreamPair:
    """Two streams on disjoint SMs: ``decode`` on ``s_decode`` SMs, ``prefill`` on ``s_prefill``.

    ``decode`` and ``prefill`` are ``torch.cuda.Stream``-compatible objects; the SM counts
    are what the driver granted (may differ from what was asked).
    """

    decode: object
    prefill: object
    s_decode: int
    s_prefill: int


@dataclass
class SelfTest:
    """Outcome of a backend's start-up check: did kernels stay on the SMs they were given?

    Attributes:
        ok: every probed split used exactly its granted number of SMs, and the two streams of
            a pair used disjoint SMs.
        detail: per split ``{s_decode: (sms seen on decode, sms seen on prefill)}``.
        reason: why it failed (empty when ok).
    """

    ok: bool
    detail: dict[int, tuple[int, int]] = field(default_factory=dict)
    reason: str = ""


class PartitionBackend(Protocol):
    """Creates stream pairs on disjoint SM sets.

    Attributes:
        name: ``greenctx``, ``tpcmask`` or ``none``.
        granularity: SMs between consecutive split levels (8 for Hopper green contexts,
            2 = one TPC for TPC masks, 0 for ``none``).
        min_sms: fewest SMs one stream may get.
        num_sms: SMs of the device.
    """

    name: str
    granularity: int
    min_sms: int
    num_sms: int

    def pair(self, s_decode: int) -> StreamPair:
        """Streams for decode on ``s_decode`` SMs and prefill on the rest (cached per level).

        Raises:
            ValueError: ``s_decode`` is not a level of this backend.
        """
        ...

    def self_test(self) -> SelfTest:
        """Probe kernels record ``%smid``; pass only if each stream stays on its SMs."""
        ...


class NoPartition:
    """No spatial plans: CPU, or GPUs/drivers where no partition backend works."""

    name = "none"
    granularity = 0
    min_sms = 0

    def __init__(self, num_sms: int = 0, reason: str = ""):
        self.num_sms = num_sms
        self.reason = reason

    def pair(self, s_decode: int) -> StreamPair:
        raise ValueError("the 'none' partition backend has no SM splits")

    def self_test(self) -> SelfTest:
        return SelfTest(ok=True)


def probe_levels(backend: PartitionBackend, levels: list[int]) -> SelfTest:
    """Run the ``%smid`` probe on both streams of each level.

    Passes when every stream used exactly the SMs it was granted (by count) and the two
    streams of a pair used disjoint SMs.
    """
    from duetserve.partition.probe import sms_used

    detail, problems = {}, []
    for s in levels:
        p = backend.pair(s)
        seen_d, seen_p = sms_used(p.decode), sms_used(p.prefill)
        detail[s] = (len(seen_d), len(seen_p))
        if len(seen_d) != p.s_decode or len(seen_p) != p.s_prefill or seen_d & seen_p:
            problems.append(f"level {s}: decode used {len(seen_d)}/{p.s_decode} SMs, prefill "
                            f"{len(seen_p)}/{p.s_prefill}, shared {len(seen_d & seen_p)}")
    return SelfTest(not problems, detail, "; ".join(problems))


def make_partition_backend(name: str, device) -> PartitionBackend:
    """The backend named ``name`` (``auto`` = ``greenctx`` on CUDA, ``none`` on CPU), self-tested.

    A backend whose self-test fails, or that cannot start, falls back along
    ``tpcmask -> greenctx -> none``; the reason is logged and kept in ``.reason`` of the
    returned ``NoPartition`` (or ``fallback_reason`` of a fallback backend).

    Raises:
        ValueError: unknown backend name.
    """
    import torch

    if name not in BACKENDS + ("auto",):
        raise ValueError(f"--partition-backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    device = torch.device(device)
    if device.type != "cuda":
        return NoPartition(0, "no CUDA device")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    chain = {"auto": ["greenctx"], "greenctx": ["greenctx"], "tpcmask": ["tpcmask", "greenctx"], "none": []}[name]
    reasons = []
    for candidate in chain:
        try:
            backend = _construct(candidate, device)
            test = backend.self_test()
        except Exception as exc:  # driver or binding missing, unsupported GPU
            reasons.append(f"{candidate}: {exc}")
            continue
        if test.ok:
            backend.fallback_reason = "; ".join(reasons)
            log.info("partition backend %s passed its self-test: %s", candidate, test.detail)
            return backend
        reasons.append(f"{candidate}: self-test failed: {test.reason}")
    reason = "; ".join(reasons) or "spatial plans disabled by --partition-backend none"
    if reasons:
        log.warning("no partition backend usable, spatial plans disabled (%s)", reason)
    return NoPartition(num_sms, reason)


def _construct(name: str, device) -> PartitionBackend:
    if name == "greenctx":
        from duetserve.partition.greenctx import GreenContextBackend

        return GreenContextBackend(device.index or 0)
    from duetserve.partition.tpcmask import TpcMaskBackend

    return TpcMaskBackend(device.index or 0)
