"""Green contexts (CUDA 12.4+ driver API, through ``cuda-bindings``): the default backend.

For each split level the device's SM resource is split by count into a decode group and
the remainder; each part becomes a green context with one non-blocking stream, wrapped as
a ``torch.cuda.ExternalStream``. Hopper: minimum and alignment 8 SMs (docs/design.md section 5).
"""
from __future__ import annotations

import torch

from duetserve.partition.base import SelfTest, StreamPair, probe_levels


def _check(result):
    """Unwrap a ``cuda.bindings`` call's ``(CUresult, *values)``; raise RuntimeError on error."""
    from cuda.bindings import driver as cu

    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


class GreenContextBackend:
    """Stream pairs from green contexts; one context pair per split level, created on first use.

    Args:
        device_index: CUDA device ordinal.

    Raises (constructor):
        RuntimeError: the driver or ``cuda-bindings`` lacks green-context support.
    """

    name = "greenctx"

    def __init__(self, device_index: int = 0):
        from cuda.bindings import driver as cu

        self._cu = cu
        torch.cuda.init()
        _check(cu.cuInit(0))
        self._dev = _check(cu.cuDeviceGet(device_index))
        self._all = _check(cu.cuDeviceGetDevResource(self._dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
        self.num_sms = self._all.sm.smCount
        major = torch.cuda.get_device_capability(device_index)[0]
        self.granularity = 8 if major >= 9 else 2
        self.min_sms = 8 if major >= 9 else 2
        self._pairs: dict[int, StreamPair] = {}
        self._handles: list = []
        self.fallback_reason = ""

    def levels(self) -> list[int]:
        """Decode SM counts this backend offers: multiples of the granularity, both sides >= min_sms."""
        return list(range(self.min_sms, self.num_sms - self.min_sms + 1, self.granularity))

    def pair(self, s_decode: int) -> StreamPair:
        """Also accepts a decode count whose complement is a level (SGLang's pdmux splits the
        prefill side off in 8-SM steps, e.g. 112/20 on 132 SMs): that side is split off then.

        Raises:
            ValueError: neither ``s_decode`` nor ``num_sms - s_decode`` is a level.
        """
        levels = self.levels()
        if s_decode not in levels and self.num_sms - s_decode not in levels:
            raise ValueError(f"{s_decode} SMs is not a green-context level ({levels[:3]}...)")
        if s_decode not in self._pairs:
            self._pairs[s_decode] = self._create(s_decode)
        return self._pairs[s_decode]

    def _create(self, s_decode: int) -> StreamPair:
        cu = self._cu
        decode_first = s_decode in self.levels()
        count = s_decode if decode_first else self.num_sms - s_decode
        groups, _, rest = _check(cu.cuDevSmResourceSplitByCount(1, self._all, 0, count))
        decode, prefill = (groups[0], rest) if decode_first else (rest, groups[0])
        streams = []
        for resource in (decode, prefill):
            desc = _check(cu.cuDevResourceGenerateDesc([resource], 1))
            ctx = _check(cu.cuGreenCtxCreate(desc, self._dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
            stream = _check(cu.cuGreenCtxStreamCreate(ctx, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
            self._handles.append((ctx, stream))
            streams.append(torch.cuda.ExternalStream(int(stream)))
        return StreamPair(decode=streams[0], prefill=streams[1], s_decode=decode.sm.smCount,
                          s_prefill=prefill.sm.smCount)

    def self_test(self) -> SelfTest:
        """Probe the smallest, a middle and the largest decode level."""
        levels = self.levels()
        return probe_levels(self, sorted({levels[0], levels[len(levels) // 2], levels[-1]}))
