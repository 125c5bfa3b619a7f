"""JSON as this project writes it: strict (RFC 8259), so that any parser reads it back.

Python's ``json.dumps`` writes the non-finite floats as the bare tokens ``Infinity``, ``-Infinity``
and ``NaN``, which are not JSON (JavaScript's ``JSON.parse`` and other strict parsers refuse the file).
"""
from __future__ import annotations

import json
import math
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` with every float JSON cannot hold replaced, in dicts, lists and tuples at any depth:
    infinity by the string ``"inf"`` (``"-inf"``), as vLLM's benchmark writes an infinite request
    rate, and NaN by ``None`` (null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def loads_object(text: str) -> dict:
    """The JSON object ``text`` holds.

    Raises:
        ValueError: "not JSON (MSG at line L column C)", or "not a JSON object but TYPE"
            (the caller adds where the text came from)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object but {type(value).__name__}")  # noqa: TRY004 (bad input, not a bad call)
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``json_safe(value)``, refusing any value left that JSON cannot hold
    (``allow_nan=False``); ``kwargs`` go to ``json.dumps`` (``indent``, ...)."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)
