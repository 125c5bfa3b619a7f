"""Argparse ``type=`` helpers shared by the command lines (serve, bench, simulate, calibrate).

The types raise ``argparse.ArgumentTypeError``, whose message argparse prints after
``argument --flag:``, so every message says what was expected and what was given.
``number`` and ``pair`` are building blocks that raise ValueError, for parsers wrapped by ``argtype``.
Checks that can only run after parsing (flags that do not go together, a flag that does not fit
the trace or the model) raise ``UsageError``; ``exit_status`` turns it into argparse's status 2.
``join_negative_values`` readies ``argv`` so that ``--flag -5ms`` reaches the flag's type.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from functools import wraps
from pathlib import Path
from typing import TypeVar

from duetserve.config import BLOCK_SIZES, parse_duration
from duetserve.engine.scheduler import MAX_LOOKAHEAD
from duetserve.traces import (
    CoincidentArrivalsError,
    TraceFileError,
    TraceFormat,
    TraceRequest,
    TraceSpec,
    load_trace,
    parse_length,
    resolve_format,
)

T = TypeVar("T")


class UsageError(ValueError):
    """A flag value, or a combination of flags, refused by a check made after parsing, before the
    command's work; the message names the flag. ``exit_status`` gives it status 2, as argparse would."""


def trace_format(trace: str | Path | None, fmt: TraceFormat, format_flag: str) -> TraceFormat:
    """The concrete format of ``--trace`` ``trace`` given as ``format_flag`` ``fmt`` (``traces.resolve_format``).

    Raises:
        UsageError: a file format without ``--trace``, ``--trace`` with the synthetic format (the
            file was ignored), a trace file that does not exist, or one whose suffix tells no format.
    """
    if fmt not in ("auto", "synthetic") and trace is None:
        raise UsageError(f"--trace FILE is required with {format_flag} {fmt}")
    if fmt == "synthetic" and trace is not None:
        raise UsageError(f"{format_flag} synthetic generates requests: drop --trace {trace}, or give its format")
    try:
        return resolve_format(trace, fmt)
    except ValueError as exc:  # "... give the format (simulate --format, bench --trace-format)"
        raise UsageError(str(exc)) from exc


def arrival_cv(cv: float | None, fmt: TraceFormat, arrival: str) -> float:
    """``--cv``'s value, 1 (Poisson) when not given; refused where no arrivals are drawn: a trace
    file replayed with ``--arrival`` ``trace`` or ``scale`` keeps its own gaps (``--cv`` was ignored).

    Raises:
        UsageError: "--cv CV does nothing with --arrival ARRIVAL: ...", naming both flags.
    """
    if cv is not None and fmt != "synthetic" and arrival != "poisson":
        raise UsageError(f"--cv {cv:g} does nothing with --arrival {arrival}: a trace file keeps its own gaps "
                         "(--arrival poisson draws gaps of that CV)")
    return 1.0 if cv is None else cv


def read_trace(trace: Path | None, spec: TraceSpec) -> list[TraceRequest]:
    """``traces.load_trace(trace, spec)`` for a command line: bad input is a UsageError naming the flag.

    Raises:
        UsageError: "--trace PATH[:LINE]: REASON" for a file that cannot be read or is no trace
            (empty, not UTF-8, malformed), a selection that holds no request (``--window``,
            ``--num-requests``), or ``--arrival scale`` of requests that all arrive at once.
        ValueError: options that do not go together (see ``traces.TraceSpec``).
    """
    try:
        requests = load_trace(trace, spec)
    except TraceFileError as exc:  # its message starts with the path
        raise UsageError(f"--trace {exc}") from exc
    except OSError as exc:
        raise UsageError(f"--trace {trace}: {exc.strerror or exc}") from exc
    except CoincidentArrivalsError as exc:
        raise UsageError("--arrival scale: the selected requests all arrive at the same time, so there is no "
                         "rate to scale; use --arrival poisson") from exc
    if not requests:
        raise UsageError("the trace selection holds no requests (see --window and --num-requests)")
    return requests


def exit_status(command: str, exc: Exception) -> int:
    """Print ``duetserve COMMAND: error: EXC`` on stderr, as argparse words its errors, and return the
    exit status: 2 for a ``UsageError`` (argparse's status for a usage error), 1 for any other failure."""
    print(f"duetserve {command}: error: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, UsageError) else 1


INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT, as a shell reports a command killed by it."""


def exit_on_interrupt(command: str, run: Callable[[], int]) -> int:
    """``run()``'s status, or after Ctrl-C ``INTERRUPTED`` with the one line "duetserve COMMAND:
    interrupted" on stderr instead of a KeyboardInterrupt traceback. ``with`` blocks unwind first,
    so a server that ``bench --launch`` started is stopped."""
    try:
        return run()
    except KeyboardInterrupt:
        print(f"duetserve {command}: interrupted", file=sys.stderr)
        return INTERRUPTED


_LONG_FLAG = re.compile(r"--[^=]+")
_NEGATIVE_VALUE = re.compile(r"-\.?\d")  # -5, -.5, -5ms, -2,4, -5:10


def join_negative_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--flag VALUE`` written ``--flag=VALUE`` where VALUE looks negative (``-5ms``,
    ``-2,4``, ``-5:10``): argparse's documented form for a value that starts with '-'.

    argparse takes an item starting with '-' for an option unless it is a plain negative number, so
    ``--tbt-slo -5ms`` failed with "expected one argument" rather than the flag's own message.
    Items after a bare ``--`` (positional from there on) are left alone.
    """
    out: list[str] = []
    for item in argv:
        if out and _LONG_FLAG.fullmatch(out[-1]) and _NEGATIVE_VALUE.match(item) and "--" not in out:
            out[-1] += "=" + item
        else:
            out.append(item)
    return out


def argtype(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` as an argparse type: its ValueError or OSError becomes ArgumentTypeError with the same message."""

    @wraps(parse)
    def wrapped(text: str) -> T:
        try:
            return parse(text)
        except (ValueError, OSError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return wrapped


def number(text: str, convert: Callable[[str], T]) -> T:
    """``convert(text)`` (``int`` or ``float``); ValueError "expected an integer|a number, got 'TEXT'"."""
    try:
        return convert(text)
    except ValueError:
        kind = "an integer" if convert is int else "a number"
        raise ValueError(f"expected {kind}, got {text!r}") from None


def _positive(value: T, text: str, what: str) -> T:
    """``value`` if it is > 0 (nan is not); else ValueError "must be a positive WHAT, got 'TEXT'"."""
    if not value > 0:
        raise ValueError(f"must be a positive {what}, got {text!r}")
    return value


@argtype
def positive_int(text: str) -> int:
    """An integer >= 1; else "must be a positive integer, got 'TEXT'"."""
    return _positive(number(text, int), text, "integer")


@argtype
def block_size(text: str) -> int:
    """``--block-size``: tokens per KV-cache block, one of ``config.BLOCK_SIZES``; else
    "must be one of 1, 8, 16, 32, 64, 128, 256, got 'TEXT'"."""
    value = number(text, int)
    if value not in BLOCK_SIZES:
        raise ValueError(f"must be one of {', '.join(map(str, BLOCK_SIZES))}, got {text!r}")
    return value


@argtype
def decode_steps(text: str) -> int:
    """``--num-decode-steps``: an integer in [1, ``scheduler.MAX_LOOKAHEAD``]; else "must be in [1, 256],
    got 'TEXT'"."""
    value = number(text, int)
    if not 1 <= value <= MAX_LOOKAHEAD:
        raise ValueError(f"must be in [1, {MAX_LOOKAHEAD}], got {text!r}")
    return value


@argtype
def non_negative_int(text: str) -> int:
    """An integer >= 0, e.g. a seed (numpy refuses negative seeds); else "must be an integer >= 0, got 'TEXT'"."""
    value = number(text, int)
    if value < 0:
        raise ValueError(f"must be an integer >= 0, got {text!r}")
    return value


@argtype
def trim_margin(text: str) -> float | str | None:
    """``--trim-margin``: ``auto`` (returned as is), ``off`` (None: the paper's rule) or a number
    in (0, 1]; else "must be a number in (0, 1], auto or off, got 'TEXT'"."""
    if text.strip() in ("auto", "off"):
        return "auto" if text.strip() == "auto" else None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise ValueError(f"must be a number in (0, 1], auto or off, got {text!r}")
    return value


@argtype
def rate(text: str) -> float:
    """A request rate in req/s: a number > 0, or ``inf`` (all at once); nan is refused."""
    return _positive(number(text, float), text, "rate (req/s) or inf")


def comma_items(text: str) -> list[str]:
    """``text`` split at commas, items stripped; ValueError "empty item in 'TEXT'" for ``2,,4`` or ``2,4,``."""
    items = [x.strip() for x in text.split(",")]
    if "" in items:
        raise ValueError(f"empty item in {text!r}")
    return items


@argtype
def rates(text: str) -> list[float]:
    """Comma-separated rates (see ``rate``), e.g. ``2,4,8``, each once. Errors: "give one or more rates,
    e.g. 2,4,8" (none), "empty item in 'TEXT'", "rate R given twice in 'TEXT'" (it would run twice)."""
    if not text.replace(",", "").strip():
        raise ValueError("give one or more rates, e.g. 2,4,8")
    values = [rate(x) for x in comma_items(text)]
    for i, value in enumerate(values):
        if value in values[:i]:
            raise ValueError(f"rate {value:g} given twice in {text!r}")
    return values


@argtype
def finite_non_negative(text: str) -> float:
    """A finite number >= 0: a coefficient of variation of arrival gaps (nan made the gap sampler loop
    forever), a lognormal sigma."""
    value = number(text, float)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"must be a finite number >= 0, got {text!r}")
    return value


def positive_duration(bare_unit: str) -> Callable[[str], float]:
    """Type of a duration > 0 in seconds, e.g. ``100ms``, ``0.1s``, ``2min``; a bare number is in ``bare_unit``.

    Errors: parse_duration's "bad duration 'TEXT': ...", or "must be a positive duration, got 'TEXT'".
    """

    @argtype
    def duration(text: str) -> float:
        return _positive(parse_duration(text, bare_unit), text, "duration")

    return duration


MIN_TBT_SLO_S = 1e-3


@argtype
def tbt_slo(text: str) -> float:
    """A TBT SLO in seconds: a finite duration (bare numbers are ms) of at least 1 ms; below that it is
    refused, naming the likely slip (``--tbt-slo 0.1`` is 0.1 ms, not 0.1 s). ``1e400`` overflows to inf,
    which served with "TBT SLO inf ms": "must be a finite duration, got '1e400'"."""
    value = _positive(parse_duration(text, "ms"), text, "duration")
    if math.isinf(value):
        raise ValueError(f"must be a finite duration, got {text!r}")
    if value < MIN_TBT_SLO_S:
        raise ValueError(f"a TBT SLO under 1 ms cannot be served, got {text!r} (bare numbers are milliseconds: "
                         f"write 100ms or 0.1s)")
    return value


def pair(text: str, parse: Callable[[str], T], form: str) -> tuple[T, T]:
    """``A:B`` as ``(parse(A), parse(B))``; ValueError "expected FORM, got 'TEXT'" without a colon."""
    low, sep, high = text.partition(":")
    if not sep:
        raise ValueError(f"expected {form}, got {text!r}")
    return parse(low), parse(high)


@argtype
def window(text: str) -> tuple[float, float]:
    """``START:END`` durations (bare numbers: seconds) as ``(start_s, end_s)``, START before END;
    else "expected START:END, got 'TEXT'" or "START must be before END, got 'TEXT'"."""
    start, end = pair(text, parse_duration, "START:END")
    if not start < end:
        raise ValueError(f"START must be before END, got {text!r}")
    return start, end


@argtype
def non_empty(text: str) -> str:
    """Any text but empty or blank ("must not be empty")."""
    if not text.strip():
        raise ValueError("must not be empty")
    return text


@argtype
def existing_file(text: str) -> Path:
    """The path of an existing file; else "TEXT is a folder, not a file" or "no such file: TEXT"."""
    if Path(text).is_dir():
        raise ValueError(f"{text} is a folder, not a file")
    if not Path(text).is_file():
        raise ValueError(f"no such file: {text}")
    return Path(text)


@argtype
def output_file(text: str) -> Path:
    """A file to write later, checked now: not a folder itself, in an existing, writable folder,
    writable itself if it exists, and opened for append once (a new file removed again), as
    permissions do not tell everything (``/proc/x.json`` passed them, and failed after the run).

    Errors: "TEXT is a folder", "no such folder: F", "F is not a folder", "folder F is not writable",
    "TEXT is not writable", "TEXT: REASON" (the error of opening it).
    """
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise ValueError(f"{text} is a folder")
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder" if folder.exists() else f"no such folder: {folder}")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"folder {folder} is not writable")
    existed = path.exists()
    if existed and not os.access(path, os.W_OK):  # a read-only file in a writable folder
        raise ValueError(f"{text} is not writable")
    try:
        open(path, "a").close()
    except OSError as exc:
        raise ValueError(f"{text}: {exc.strerror or exc}") from exc
    if not existed:
        path.unlink()
    return path


def write_output(path: Path, text: str, flag: str) -> None:
    """Write ``text`` to ``path``, the value of ``flag`` (checked by ``output_file`` before the work);
    a failure now (the folder removed, the disk full) is an OSError "FLAG PATH: REASON"."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise OSError(f"{flag} {path}: {exc.strerror or exc}") from exc


def image_formats() -> list[str]:
    """The image file suffixes matplotlib can save to, without the dot (png, pdf, svg, ...), sorted."""
    from matplotlib.figure import Figure  # imported only where a plot is asked for

    return sorted(Figure().canvas.get_supported_filetypes())


@argtype
def plot_file(text: str) -> Path:
    """An image to draw later: ``output_file``'s checks, then a suffix matplotlib can save to, so a bad
    ``--plot`` fails before the work whose results it draws.

    Errors: those of ``output_file``, "TEXT has no image suffix; use one of .avif, .eps, ...",
    "TEXT: matplotlib cannot write .SUFFIX images; use one of .avif, .eps, ...".
    """
    path = output_file(text)
    formats = image_formats()
    use = f"use one of {', '.join('.' + f for f in formats)}"
    suffix = path.suffix[1:].lower()  # matplotlib lower-cases it too
    if not suffix:  # savefig would append .png, so the file printed would not be the one written
        raise ValueError(f"{text} has no image suffix; {use}")
    if suffix not in formats:
        raise ValueError(f"{text}: matplotlib cannot write .{suffix} images; {use}")
    return path


def add_length_options(group: argparse._ArgumentGroup) -> None:
    """``--input-len`` and ``--output-len`` (bench and simulate): lengths of synthetic requests, in tokens.

    A value is parse_length's N, LOW:HIGH or lognormal:MEAN:SIGMA; its ValueError becomes the flag's error.
    """
    for flag, default in (("--input-len", "512"), ("--output-len", "128")):
        group.add_argument(flag, type=argtype(parse_length), default=default, metavar="SPEC",
                           help=f"synthetic: N, LOW:HIGH or lognormal:MEAN:SIGMA (default {default})")
