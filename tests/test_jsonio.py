"""Strict JSON output (duetserve.jsonio): no bare NaN or Infinity tokens."""
from __future__ import annotations

import json
import math

import pytest

from duetserve.jsonio import dumps, json_safe


def strict_loads(text: str):
    """``json.loads`` that fails on the non-JSON tokens Python's json writes and reads (NaN, Infinity)."""
    return json.loads(text, parse_constant=lambda token: pytest.fail(f"not JSON: {token}"))


def test_non_finite_floats_become_inf_strings_and_null():
    value = {"qps": math.inf, "low": -math.inf, "p99": math.nan, "rows": [(1.5, math.inf)], "n": 3, "name": "x"}
    assert json_safe(value) == {"qps": "inf", "low": "-inf", "p99": None, "rows": [[1.5, "inf"]], "n": 3,
                                "name": "x"}
    assert dumps(value) == ('{"qps": "inf", "low": "-inf", "p99": null, "rows": [[1.5, "inf"]], "n": 3, '
                            '"name": "x"}')
    assert value["qps"] == math.inf  # the caller's value is left as it was


def test_what_json_safe_cannot_map_is_refused():
    class Half(float):
        pass

    assert dumps({"x": Half(0.5)}) == '{"x": 0.5}'
    with pytest.raises(TypeError, match="not JSON serializable"):
        dumps({"x": {1, 2}})


def test_loads_object_names_what_is_wrong():
    from duetserve.jsonio import loads_object

    assert loads_object('{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(ValueError, match=r"^not JSON \(Expecting ',' delimiter at line 2 column 1\)$"):
        loads_object('{"a": 1\n"b": 2}')
    with pytest.raises(ValueError, match="^not a JSON object but list$"):
        loads_object("[1, 2]")
