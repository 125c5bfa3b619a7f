"""Fitting the cost model's per-kernel overheads to measured iteration latencies (beyond the
DuetServe paper; docs/design.md section 3, "go beyond the paper where measurement says so").

The model (``duetserve.planner.cost_model``, module docstring): an iteration of ``n`` kernels
with roofline time ``r`` takes ``r + n g`` when replayed from CUDA graphs and
``max(r + n g, n h)`` when launched eagerly; ``g = kernel_gpu_s``, ``h = launch_cpu_s``.

The fit, in two stages, each minimising the sum of relative errors ``|pred - meas| / meas``
(L1: robust to a few shapes the roofline itself misses, and aimed at the relative error the
calibration reports):

1. ``g`` from the graph-replayed iterations alone, where no host launch hides the GPU's
   per-kernel time: the weighted median of ``(meas - r) / n`` with weights ``n / meas``, the
   exact minimiser of ``sum |r + n g - meas| / meas``; at least 0; 0 without such rows.
   Eager iterations do not enter: a large eager prefill also carries errors of the roofline
   proper (GEMMs below the calibration GEMM's rate, unfused elementwise kernels whose bytes
   grow with the tokens) that a per-kernel constant would absorb wrongly (stage 0 takes them).
2. ``h`` from the eager iterations, ``g`` fixed: the objective is piecewise linear in ``h``
   with breaks where ``n h`` meets ``meas`` or ``r + n g``, so its minimum over ``h >= 0`` is
   at 0 or one of those breaks; all are tried (ties: the smallest ``h``).

Stage 0, beneath both: the profile's ``gemm_efficiency`` ``e`` (``HardwareProfile``: the share
of ``Pi(S)``, the GEMM curve measured on one bf16 8192^3 product, that the model's token-level
operators reach). The served model's GEMMs at a few thousand tokens reach less of that curve
(two H200 calibrations fitted 0.80-0.85: other shapes, and a power-capped chip clocking down
under a long prefill), a shortfall that grows with the tokens, which no per-kernel constant
can carry. Each ``e`` of ``EFFICIENCY_GRID`` rescales the roofline (``fit_with_efficiency``'s
``roofline_at``), stages 1 and 2 fit at it, and the ``e`` whose fit has the least sum of
relative errors over all rows wins (ties: the larger ``e``).

Kernel counts come from the engine (``split_kernel_counts`` of a profiled forward). The fit
is checked on shapes it did not see (``holdout_mask``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike

from duetserve.planner.cost_model import kernel_bound


@dataclass(frozen=True)
class OverheadFit:
    """Fitted per-kernel constants, seconds: ``kernel_gpu_s`` (GPU time beyond the roofline)
    and ``launch_cpu_s`` (host time of one eager launch); ``gemm_efficiency`` (in (0, 1]) the
    share of ``Pi(S)`` the roofline took (stage 0, module docstring)."""

    kernel_gpu_s: float
    launch_cpu_s: float
    gemm_efficiency: float = 1.0


EFFICIENCY_GRID = tuple(round(0.5 + 0.01 * i, 2) for i in range(51))
"""``gemm_efficiency`` values stage 0 tries: 0.50, 0.51, ..., 1.00."""


def split_kernel_counts(names: Iterable[str], layers: int) -> tuple[int, int]:
    """``(kernels per layer, kernels per forward outside the layers)`` from the names of every
    GPU activity (kernel, memcpy, memset) of one forward of a ``layers``-layer model.

    Each decoder layer launches the same kernels, so a name seen ``m`` times contributes
    ``m // layers`` per layer and ``m % layers`` outside (the final norm shares the layers'
    norm kernel, lm_head their GEMM). Assumes nothing outside the layers launches one kernel
    ``layers`` times or more. Raises ValueError for ``layers < 1``.
    """
    if layers < 1:
        raise ValueError("layers must be >= 1")
    counts = Counter(names)
    per_layer = sum(m // layers for m in counts.values())
    return per_layer, sum(counts.values()) - per_layer * layers


def holdout_mask(groups: Iterable[object]) -> np.ndarray:
    """Which rows are held out of the fit: within each group (e.g. ``(kind, graphs)``), in the
    order given, every second row (the 2nd, 4th, ...); the 1st, 3rd, ... fit. Alternating
    keeps both halves spread over batch sizes and contexts."""
    seen: Counter = Counter()
    mask = []
    for g in groups:
        mask.append(seen[g] % 2 == 1)
        seen[g] += 1
    return np.array(mask, dtype=bool)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The smallest value whose cumulative weight reaches half the total."""
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cum, cum[-1] / 2)])


def fit_overheads(roofline: ArrayLike, kernels: ArrayLike, graphs: ArrayLike, measured: ArrayLike) -> OverheadFit:
    """Fit ``kernel_gpu_s`` and ``launch_cpu_s`` (module docstring) to iterations with
    roofline seconds ``roofline``, ``kernels`` launched, ``graphs`` True where replayed from
    CUDA graphs, and ``measured`` seconds (equal-length sequences).

    Raises ValueError for different lengths, no rows, kernel counts < 1 or measured <= 0.
    """
    r, n, m = (np.asarray(a, dtype=float) for a in (roofline, kernels, measured))
    replay = np.asarray(graphs, dtype=bool)
    if not (r.shape == n.shape == m.shape == replay.shape) or r.ndim != 1 or not r.size:
        raise ValueError("roofline, kernels, graphs and measured need one value per iteration, at least one")
    if n.min() < 1 or m.min() <= 0:
        raise ValueError("kernel counts must be >= 1 and measured times positive")
    g = 0.0
    if replay.any():
        rr, nn, mm = r[replay], n[replay], m[replay]
        g = max(0.0, _weighted_median((mm - rr) / nn, nn / mm))
    h = 0.0
    eager = ~replay
    if eager.any():
        re, ne, me = r[eager], n[eager], m[eager]
        gpu = re + ne * g
        candidates = np.unique(np.concatenate([[0.0], me / ne, gpu / ne]))
        cost = np.abs(np.maximum(gpu[None, :], candidates[:, None] * ne[None, :]) - me[None, :]) / me[None, :]
        h = float(candidates[np.argmin(cost.sum(axis=1))])
    return OverheadFit(g, h)


def predict_fitted(roofline: ArrayLike, kernels: ArrayLike, graphs: ArrayLike, fit: OverheadFit) -> np.ndarray:
    """Seconds the model gives iterations of ``roofline`` seconds and ``kernels`` launched,
    ``graphs`` True where replayed (module docstring: ``r + n g``, eager ``max(r + n g, n h)``).
    ``roofline`` must already carry ``fit.gemm_efficiency``."""
    return kernel_bound(roofline, kernels, kernels, graphs, fit.kernel_gpu_s, fit.launch_cpu_s)


def fit_with_efficiency(roofline_at: Callable[[float], ArrayLike], kernels: ArrayLike, graphs: ArrayLike,
                        measured: ArrayLike, grid: Iterable[float] = EFFICIENCY_GRID) -> OverheadFit:
    """Stages 0-2 of the module docstring: for each ``e`` of ``grid``, ``fit_overheads`` on the
    rooflines ``roofline_at(e)`` (seconds, one per iteration, with ``Pi(S)`` scaled by ``e``);
    returns the fit, ``gemm_efficiency`` included, whose predictions have the least sum of
    relative errors ``|pred - meas| / meas`` (ties: the larger ``e``).

    Raises ValueError as ``fit_overheads``, and for an empty grid or one outside (0, 1].
    """
    values = sorted(set(grid), reverse=True)
    if not values or not 0.0 < values[-1] <= values[0] <= 1.0:
        raise ValueError(f"gemm_efficiency grid must be non-empty and in (0, 1], got {values}")
    m = np.asarray(measured, dtype=float)
    best, best_cost = None, np.inf
    for e in values:
        r = np.asarray(roofline_at(e), dtype=float)
        fit = replace(fit_overheads(r, kernels, graphs, m), gemm_efficiency=e)
        cost = float((np.abs(predict_fitted(r, kernels, graphs, fit) - m) / m).sum())
        if cost < best_cost * (1 - 1e-12):
            best, best_cost = fit, cost
    return best
