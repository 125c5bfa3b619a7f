"""Request traces for replay: readers for public traces, synthetic load, and arrival transforms.

Shared by the HTTP benchmark (``duetserve bench``) and the simulator. Every reader returns a
list of :class:`TraceRequest` sorted by arrival time, with arrival times in seconds relative to
the start of the trace. :func:`load_trace` is the single entry point; :class:`TraceSpec` holds
its options.

Supported sources:

- ``azure``: Azure LLM inference trace 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``;
  timestamps are wall-clock strings with 7 fractional digits).
- ``mooncake``: Mooncake FAST'25 JSONL (``timestamp`` in ms, ``input_length``, ``output_length``,
  ``hash_ids`` of 512-token prefix blocks).
- ``synthetic``: Poisson or gamma arrivals at a QPS with fixed, uniform or lognormal lengths.

Trace data files are never part of the repository; pass their path.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from duetserve.jsonio import loads_object

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per entry of a Mooncake request's ``hash_ids`` (prefix-cache block size)."""

TraceFormat = Literal["auto", "azure", "mooncake", "synthetic"]
ArrivalMode = Literal["trace", "scale", "poisson"]


@dataclass
class TraceRequest:
    """One request of a trace.

    Attributes:
        arrival_s: arrival time in seconds, relative to the start of the trace (>= 0).
        input_len: prompt length in tokens (>= 1).
        output_len: number of tokens to generate (>= 1).
        hash_ids: optional prefix-block ids (Mooncake); requests sharing leading ids share
            the same leading ``MOONCAKE_BLOCK_TOKENS``-token prompt blocks.
    """

    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: list[int] | None = None


# ---------------------------------------------------------------------------------------------
# Length distributions for synthetic traces


class LengthDist(Protocol):
    """A distribution of token lengths."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` lengths in tokens (integers >= 1)."""
        ...


@dataclass(frozen=True)
class FixedLength:
    """Every request has ``tokens`` tokens."""

    tokens: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Return ``n`` copies of ``tokens``."""
        return np.full(n, self.tokens, dtype=np.int64)


@dataclass(frozen=True)
class UniformLength:
    """Lengths drawn uniformly from the integers in ``[low, high]`` (inclusive), in tokens."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` integers uniformly from ``[low, high]``."""
        return rng.integers(self.low, self.high + 1, size=n)


@dataclass(frozen=True)
class LognormalLength:
    """Lognormal lengths with mean ``mean`` tokens and log-space standard deviation ``sigma``.

    Draws are rounded to integers and clipped to at least 1 token.
    """

    mean: float
    sigma: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` lengths; the underlying normal has mu = ln(mean) - sigma^2 / 2."""
        mu = math.log(self.mean) - self.sigma**2 / 2
        return np.maximum(1, np.rint(rng.lognormal(mu, self.sigma, size=n))).astype(np.int64)


def parse_length(text: str) -> LengthDist:
    """Parse a length distribution: ``"512"`` (fixed), ``"128:1024"`` (uniform, inclusive) or
    ``"lognormal:MEAN:SIGMA"`` (lognormal with mean MEAN tokens, log-space std SIGMA).

    Raises:
        ValueError: malformed text, lengths < 1 or above ``MAX_LENGTH``, ``low > high``, or
            ``sigma`` outside [0, ``MAX_SIGMA``] (inf sent max_tokens -2^63, 10^20 overflowed).
    """
    parts = text.strip().split(":")
    try:
        if parts[0] == "lognormal" and len(parts) == 3:
            dist: LengthDist = LognormalLength(float(parts[1]), float(parts[2]))
            valid = 1 <= dist.mean <= MAX_LENGTH and 0 <= dist.sigma <= MAX_SIGMA
        elif len(parts) == 2:
            dist = UniformLength(int(parts[0]), int(parts[1]))
            valid = 1 <= dist.low <= dist.high <= MAX_LENGTH
        elif len(parts) == 1:
            dist = FixedLength(int(parts[0]))
            valid = 1 <= dist.tokens <= MAX_LENGTH
        else:
            valid = False
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(
            f"bad length {text!r}: expected N, LOW:HIGH or lognormal:MEAN:SIGMA with lengths in [1, {MAX_LENGTH}] "
            f"and SIGMA in [0, {MAX_SIGMA:g}]"
        )
    return dist


MAX_LENGTH = 10**8
"""Most tokens a synthetic length may ask for (far above any model's context)."""
MAX_SIGMA = 5.0
"""Widest log-space spread of a lognormal length (exp(5) is already a factor of 148)."""


# ---------------------------------------------------------------------------------------------
# Readers


class TraceFileError(ValueError):
    """A trace file whose contents cannot be read as a trace; the message starts with the file's
    path (and the line: ``PATH:LINE: ...``)."""


class CoincidentArrivalsError(ValueError):
    """Arrival ``scale`` asked of requests that all arrive at the same time: no rate to scale."""


def _check_lengths(input_len: int, output_len: int, where: str) -> None:
    if input_len < 1 or output_len < 1:
        raise TraceFileError(f"{where}: token lengths must be >= 1, got {input_len}/{output_len}")


def _read_text(path: str | Path) -> str:
    """The text of trace file ``path``, decoded as UTF-8 (a leading byte-order mark dropped, as
    spreadsheet programs write one and it would hide the first column's name).

    Raises:
        OSError: the file cannot be read.
        TraceFileError: an empty file, or bytes that are not UTF-8 (naming the line).
    """
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TraceFileError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    if not text.strip():
        raise TraceFileError(f"{path}: the file is empty")
    return text


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
"""Columns an Azure trace CSV must have (others are ignored)."""


def _azure_time(stamp: str, where: str) -> tuple[int, float]:
    """Whole seconds since the epoch (UTC) and the fraction of a second, of an Azure
    ``YYYY-MM-DD HH:MM:SS[.fffffff]`` timestamp (kept apart so differences stay exact).

    Raises:
        TraceFileError: "WHERE: TIMESTAMP must be YYYY-MM-DD HH:MM:SS[.FRACTION], got 'STAMP'".
    """
    whole, _, frac = stamp.strip().partition(".")
    try:
        if frac and not (frac.isascii() and frac.isdigit()):
            raise ValueError(frac)
        base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    except ValueError:
        raise TraceFileError(f"{where}: TIMESTAMP must be YYYY-MM-DD HH:MM:SS[.FRACTION], got {stamp!r}") from None
    return int(base.timestamp()), float("0." + frac) if frac else 0.0


def _azure_tokens(text: str, column: str, where: str) -> int:
    """The token count ``text`` of ``column``.

    Raises:
        TraceFileError: "WHERE: COLUMN must be a whole number >= 1, got 'TEXT'" (e.g. 'nan', '2.5', '0').
    """
    try:
        tokens = int(text)
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise TraceFileError(f"{where}: {column} must be a whole number >= 1, got {text!r}")
    return tokens


def read_azure_csv(path: str | Path) -> list[TraceRequest]:
    """Read an Azure LLM inference trace 2023 CSV: a header naming at least ``AZURE_COLUMNS``, then
    one row of as many fields per request (blank lines are skipped).

    Rows are sorted by timestamp (stably: rows with the same timestamp keep their order), as
    trace replayers treat a trace as a schedule; arrival times are relative to the earliest.
    Fractional seconds of any number of digits are accepted (the published files have 7).

    Raises:
        OSError: the file cannot be read.
        TraceFileError: an empty or non-UTF-8 file, a missing column, no rows, a row with more or
            fewer fields than the header (a file cut mid-line), a bad timestamp, or a token count
            that is not a whole number >= 1 (with the line number).
    """
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    header = next(reader, [])
    missing = sorted(set(AZURE_COLUMNS) - set(header))
    if missing:
        raise TraceFileError(f"{path}: not an Azure trace, missing columns {missing}")
    columns = [header.index(name) for name in AZURE_COLUMNS]
    rows = []
    for fields in reader:
        if not fields:
            continue
        where = f"{path}:{reader.line_num}"
        if len(fields) != len(header):
            raise TraceFileError(f"{where}: expected {len(header)} columns ({', '.join(header)}), got {len(fields)}")
        stamp, context, generated = (fields[i] for i in columns)
        rows.append((_azure_time(stamp, where), _azure_tokens(context, "ContextTokens", where),
                     _azure_tokens(generated, "GeneratedTokens", where)))
    if not rows:
        raise TraceFileError(f"{path}: no requests, only the header")
    rows.sort(key=lambda row: row[0])
    (s0, f0) = rows[0][0]
    return [TraceRequest((s - s0) + (f - f0), i, o) for (s, f), i, o in rows]


_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


def _mooncake_record(text: str) -> TraceRequest:
    """One line of a Mooncake trace.

    Raises:
        ValueError: the line is not a JSON object, lacks a field of ``_MOONCAKE_FIELDS``, or
            holds a value that is not a number (``hash_ids``: not a list of integers).
    """
    rec = loads_object(text)
    missing = [name for name in _MOONCAKE_FIELDS if name not in rec]
    if missing:
        raise ValueError(f"missing fields {missing}")
    try:
        req = TraceRequest(
            arrival_s=float(rec["timestamp"]) / 1000.0,
            input_len=int(rec["input_length"]),
            output_len=int(rec["output_length"]),
            hash_ids=[int(h) for h in rec["hash_ids"]] if "hash_ids" in rec else None,
        )
    except (TypeError, ValueError, OverflowError) as e:  # OverflowError: 1e400 parses as inf
        raise ValueError(f"{type(e).__name__}: {e}") from e
    if not 0 <= req.arrival_s < math.inf:  # NaN made the simulator spin and bench sleep forever
        raise ValueError(f"timestamp must be a finite number of ms >= 0, got {rec['timestamp']!r}")
    return req


def read_mooncake_jsonl(path: str | Path) -> list[TraceRequest]:
    """Read a Mooncake FAST'25 JSONL trace (``timestamp`` in ms, lengths, ``hash_ids``). Records
    are sorted by timestamp (stably) and arrival times are relative to the earliest, as
    ``read_azure_csv``'s (a file cut from the middle of a trace waited its first timestamp,
    1593 s, before sending anything).

    Raises:
        OSError: the file cannot be read.
        TraceFileError: an empty or non-UTF-8 file, invalid JSON, a missing field, or a length
            < 1 (with the line number); a first record that fails says the file is not a Mooncake trace.
    """
    out = []
    for line, text in enumerate(_read_text(path).splitlines(), start=1):
        if not text.strip():
            continue
        where = f"{path}:{line}"
        try:
            req = _mooncake_record(text)
        except ValueError as e:
            kind = "" if out else "not a Mooncake trace (JSON lines): "
            raise TraceFileError(f"{where}: {kind}{e}") from e
        _check_lengths(req.input_len, req.output_len, where)
        out.append(req)
    out.sort(key=lambda r: r.arrival_s)
    return [replace(r, arrival_s=r.arrival_s - out[0].arrival_s) for r in out]


def gamma_arrivals(n: int, qps: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in seconds of ``n`` requests at mean rate ``qps`` requests/s.

    The first request arrives at 0; gaps are gamma-distributed with coefficient of variation
    ``cv`` (1 = Poisson, 0 = evenly spaced, > 1 = bursty). ``qps = inf`` puts every arrival at 0.

    Raises:
        ValueError: ``qps <= 0`` (or NaN), or ``cv`` negative or not finite.
    """
    if not qps > 0 or not 0 <= cv < math.inf:
        raise ValueError(f"need qps > 0 and a finite cv >= 0, got qps={qps}, cv={cv}")
    if math.isinf(qps) or n == 0:
        return np.zeros(n)
    if cv == 0:
        gaps = np.full(n - 1, 1.0 / qps)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (qps * shape), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def synthetic_trace(
    num_requests: int,
    qps: float,
    cv: float,
    input_len: LengthDist,
    output_len: LengthDist,
    seed: int,
) -> list[TraceRequest]:
    """A synthetic trace: gamma arrivals (see :func:`gamma_arrivals`) and sampled lengths.

    Lengths and arrivals use independent random streams derived from ``seed``, so changing
    ``qps`` keeps the same lengths.

    Raises:
        ValueError: ``num_requests < 0``, or bad ``qps``/``cv``.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    ins = input_len.sample(np.random.default_rng([seed, 0]), num_requests)
    outs = output_len.sample(np.random.default_rng([seed, 1]), num_requests)
    times = gamma_arrivals(num_requests, qps, cv, np.random.default_rng([seed, 2]))
    return [TraceRequest(float(t), int(i), int(o)) for t, i, o in zip(times, ins, outs)]


# ---------------------------------------------------------------------------------------------
# Selection and transforms


@dataclass
class TraceSpec:
    """Options of :func:`load_trace`.

    Attributes:
        format: ``azure``, ``mooncake``, ``synthetic``, or ``auto`` (by file suffix: ``.csv`` is
            Azure, ``.jsonl`` Mooncake; no path means synthetic).
        arrival: ``trace`` keeps the trace's arrival times (for synthetic traces: the generated
            gamma arrivals at ``qps``); ``scale`` stretches them so the mean rate is ``qps``;
            ``poisson`` re-draws them at ``qps`` with gamma gaps of CV ``cv`` (1 = Poisson).
        qps: target rate in requests/s (``inf``: all at once). Required for synthetic traces
            and for ``scale``/``poisson``; not allowed with ``trace`` on a file.
        cv: coefficient of variation of inter-arrival gaps for generated arrivals.
        window_s: keep requests arriving in ``[start, end)`` seconds of the trace; arrival
            times are then measured from ``start``.
        num_requests: keep the first N requests (after the window); for synthetic traces, the
            number of requests generated (required).
        max_input_len: cap input lengths at this many tokens.
        max_output_len: cap output lengths at this many tokens.
        input_len: synthetic input length distribution.
        output_len: synthetic output length distribution.
        seed: seed for everything random.
    """

    format: TraceFormat = "auto"
    arrival: ArrivalMode = "trace"
    qps: float | None = None
    cv: float = 1.0
    window_s: tuple[float, float] | None = None
    num_requests: int | None = None
    max_input_len: int | None = None
    max_output_len: int | None = None
    input_len: LengthDist = FixedLength(512)
    output_len: LengthDist = FixedLength(128)
    seed: int = 0


def resolve_format(path: str | Path | None, fmt: TraceFormat) -> TraceFormat:
    """The concrete format for ``path``: ``fmt`` itself unless it is ``auto``.

    Raises:
        ValueError: ``path`` is not a file, ``auto`` with an unknown suffix, or a file format
            without a path.
    """
    if path is not None and not Path(path).is_file():
        raise ValueError(f"no such trace file: {path}")
    if fmt == "auto":
        if path is None:
            return "synthetic"
        suffixes = {".csv": "azure", ".jsonl": "mooncake"}
        if Path(path).suffix not in suffixes:
            raise ValueError(f"cannot infer the trace format of {path} from its suffix (.csv: azure, .jsonl: "
                             "mooncake); give the format (simulate --format, bench --trace-format)")
        return suffixes[Path(path).suffix]  # type: ignore[return-value]
    if fmt != "synthetic" and path is None:
        raise ValueError(f"format {fmt!r} needs a trace file path")
    return fmt


def _rescale(reqs: list[TraceRequest], qps: float) -> list[TraceRequest]:
    """Stretch arrivals (first at 0) so the mean inter-arrival gap is ``1 / qps`` seconds."""
    if math.isinf(qps) or len(reqs) < 2:
        return [replace(r, arrival_s=0.0) for r in reqs]
    t0, span = reqs[0].arrival_s, reqs[-1].arrival_s - reqs[0].arrival_s
    if span <= 0:
        raise CoincidentArrivalsError("cannot scale a trace whose arrivals all coincide; use arrival 'poisson'")
    stretch = (len(reqs) - 1) / (qps * span)
    return [replace(r, arrival_s=(r.arrival_s - t0) * stretch) for r in reqs]


def _capped(req: TraceRequest, max_input: int | None, max_output: int | None) -> TraceRequest:
    """``req`` with lengths capped; ``hash_ids`` trimmed to the blocks the capped prompt covers."""
    input_len = req.input_len if max_input is None else min(req.input_len, max_input)
    output_len = req.output_len if max_output is None else min(req.output_len, max_output)
    hash_ids = req.hash_ids
    if hash_ids is not None:
        hash_ids = hash_ids[: math.ceil(input_len / MOONCAKE_BLOCK_TOKENS)]
    return replace(req, input_len=input_len, output_len=output_len, hash_ids=hash_ids)


def load_trace(path: str | Path | None, spec: TraceSpec | None = None) -> list[TraceRequest]:
    """Load a trace and apply the selection and transforms of ``spec``.

    Steps, in order: read (or generate), time window, first N, length caps, arrival transform.

    Args:
        path: trace file, or ``None`` for a synthetic trace.
        spec: options; defaults to ``TraceSpec()``.

    Returns:
        Requests sorted by arrival time, arrivals in seconds from the start (first at >= 0).

    Raises:
        OSError: the file cannot be read.
        TraceFileError: bad file contents (a ValueError whose message starts with the path).
        ValueError: inconsistent options (see :class:`TraceSpec`).
    """
    spec = spec or TraceSpec()
    fmt = resolve_format(path, spec.format)
    if fmt == "synthetic":
        if spec.num_requests is None or spec.qps is None:
            raise ValueError("a synthetic trace needs a number of requests and a QPS (--num-requests and --qps)")
        reqs = synthetic_trace(
            spec.num_requests, spec.qps, spec.cv, spec.input_len, spec.output_len, spec.seed
        )
    else:
        if spec.arrival == "trace" and spec.qps is not None:
            raise ValueError("qps needs arrival 'scale' or 'poisson' for a trace file")
        reader = read_azure_csv if fmt == "azure" else read_mooncake_jsonl
        reqs = reader(path)  # type: ignore[arg-type]

    if spec.window_s is not None:
        start, end = spec.window_s
        if not start < end:
            raise ValueError(f"empty window [{start}, {end})")
        reqs = [replace(r, arrival_s=r.arrival_s - start) for r in reqs if start <= r.arrival_s < end]
    if spec.num_requests is not None:
        reqs = reqs[: spec.num_requests]
    if spec.max_input_len is not None or spec.max_output_len is not None:
        if any(c is not None and c < 1 for c in (spec.max_input_len, spec.max_output_len)):
            raise ValueError("length caps must be >= 1 token")
        reqs = [_capped(r, spec.max_input_len, spec.max_output_len) for r in reqs]

    if spec.arrival == "trace":
        return reqs
    if spec.qps is None:
        raise ValueError(f"arrival {spec.arrival!r} needs qps")
    if spec.arrival == "scale":
        return _rescale(reqs, spec.qps)
    if spec.arrival == "poisson":
        times = gamma_arrivals(len(reqs), spec.qps, spec.cv, np.random.default_rng([spec.seed, 3]))
        return [replace(r, arrival_s=float(t)) for r, t in zip(reqs, times)]
    raise ValueError(f"unknown arrival mode {spec.arrival!r}")
