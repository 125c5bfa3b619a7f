"""TPC masks on ordinary streams (libsmctrl-style), through ctypes.

Uses a user's ``libsmctrl.so`` (``--libsmctrl PATH`` or ``$DUETSERVE_LIBSMCTRL``, through its
``libsmctrl_set_stream_mask_ext``) or the project's own shim ``native/tpcmask.c``, compiled
with the system C compiler on first use. Granularity: 1 TPC = 2 SMs, in logical TPC order
(docs/design.md section 5). The per-stream mask field sits at a driver-version specific offset.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import torch

from duetserve.partition.base import SelfTest, StreamPair, probe_levels

# cuDriverGetVersion() -> byte offset of the mask field in the driver's stream object, x86-64.
# 13000 was checked on the lent H200 (driver 580.159); the rest are leads from libsmctrl.
MASK_OFFSETS = {(13000, 13000): 0x51C, (12070, 12080): 0x4FC, (12050, 12060): 0x4EC, (12040, 12040): 0x4AC,
                (12030, 12030): 0x49C, (12020, 12020): 0x4E4, (12000, 12010): 0x4CC}

NATIVE_SRC = Path(__file__).resolve().parents[2] / "native" / "tpcmask.c"


def mask_offset(driver_version: int) -> int:
    """Mask-field offset for a ``cuDriverGetVersion`` value.

    Raises:
        RuntimeError: the version's offset is unknown (the backend is refused).
    """
    for (lo, hi), offset in MASK_OFFSETS.items():
        if lo <= driver_version <= hi:
            return offset
    raise RuntimeError(f"no known TPC-mask offset for CUDA driver version {driver_version}")


def disabled_words(keep: range, num_tpcs: int) -> list[int]:
    """Four 32-bit words (low first) with a bit set for every TPC of ``range(num_tpcs)`` not in ``keep``."""
    bits = sum(1 << t for t in range(num_tpcs) if t not in keep)
    return [(bits >> (32 * i)) & 0xFFFFFFFF for i in range(4)]


def build_native(cache_dir: Path | None = None) -> Path:
    """Compile ``native/tpcmask.c`` into a shared library (once; reused while the source is unchanged).

    Raises:
        RuntimeError: no C compiler, or compilation failed.
    """
    cache_dir = cache_dir or Path(os.environ.get("DUETSERVE_CACHE", Path.home() / ".cache" / "duetserve"))
    out = cache_dir / f"libduet_tpcmask-{int(NATIVE_SRC.stat().st_mtime_ns)}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        try:
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(NATIVE_SRC)], check=True,
                           capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise RuntimeError(f"cannot build the TPC-mask shim with {cc}: {exc}") from exc
    return out


class TpcMaskBackend:
    """Stream pairs on the same context, restricted by per-stream TPC masks.

    Args:
        device_index: CUDA device ordinal.
        libsmctrl: path of a ``libsmctrl.so`` to use instead of the project's shim.

    Raises (constructor):
        RuntimeError: unknown driver version, or the shim cannot be built or loaded.
    """

    name = "tpcmask"
    granularity = 2
    # Fewest SMs on either stream. On the H200, cuBLAS decode GEMMs (qkv 4096->6144, down
    # 12288->4096) never finished on a stream masked to 16 SMs and all finished on 32
    # (scripts/tpcmask_watchdog.py, docs/benchmarks.md 2026-11-30).
    min_sms = 32

    def __init__(self, device_index: int = 0, libsmctrl: str | None = None):
        from cuda.bindings import driver as cu

        from duetserve.partition.greenctx import _check

        torch.cuda.init()
        self.device_index = device_index
        self.num_sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        self.num_tpcs = self.num_sms // 2
        self.offset = mask_offset(_check(cu.cuDriverGetVersion()))
        libsmctrl = libsmctrl or os.environ.get("DUETSERVE_LIBSMCTRL")
        self._libsmctrl = ctypes.CDLL(libsmctrl) if libsmctrl else None
        self._shim = None if self._libsmctrl else ctypes.CDLL(str(build_native()))
        self._pairs: dict[int, StreamPair] = {}
        self.fallback_reason = ""

    def levels(self) -> list[int]:
        return list(range(self.min_sms, self.num_sms - self.min_sms + 1, self.granularity))

    def set_mask(self, stream: torch.cuda.Stream, keep: range) -> None:
        """Restrict ``stream`` to the TPCs in ``keep`` (logical TPC ids)."""
        words = disabled_words(keep, self.num_tpcs)
        handle = ctypes.c_void_p(stream.cuda_stream)
        if self._libsmctrl is not None:
            # libsmctrl_set_stream_mask_ext(stream, __uint128_t mask): on x86-64 the 128-bit
            # argument travels as two 64-bit halves, low first.
            low, high = words[0] | words[1] << 32, words[2] | words[3] << 32
            self._libsmctrl.libsmctrl_set_stream_mask_ext(handle, ctypes.c_uint64(low), ctypes.c_uint64(high))
            return
        arr = (ctypes.c_uint32 * 4)(*words)
        if self._shim.duet_set_stream_tpc_mask(handle, ctypes.c_uint32(self.offset), arr) != 0:
            raise RuntimeError("could not set the stream's TPC mask")

    def pair(self, s_decode: int) -> StreamPair:
        if s_decode not in self.levels():
            raise ValueError(f"{s_decode} SMs is not a TPC-mask level ({self.min_sms}..{self.num_sms - self.min_sms} "
                             f"in steps of {self.granularity})")
        if s_decode not in self._pairs:
            with torch.cuda.device(self.device_index):
                decode, prefill = torch.cuda.Stream(), torch.cuda.Stream()
            split = s_decode // 2
            self.set_mask(decode, range(split))
            self.set_mask(prefill, range(split, self.num_tpcs))
            self._pairs[s_decode] = StreamPair(decode, prefill, s_decode, self.num_sms - s_decode)
        return self._pairs[s_decode]

    def self_test(self) -> SelfTest:
        """Probe the smallest, a middle and the largest split."""
        levels = self.levels()
        return probe_levels(self, sorted({levels[0], levels[len(levels) // 2], levels[-1]}))
