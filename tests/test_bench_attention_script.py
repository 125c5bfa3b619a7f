"""CPU tests of scripts/bench_attention.py's host-side parts (the timing needs a GPU)."""
from __future__ import annotations

import gzip
import json

import pytest
from conftest import load_script

ba = load_script("bench_attention")


def _record(decodes: list[int], prefill_tokens: int = 0) -> dict:
    """An iteration log line as the server writes it: [new, cached] per sequence, decodes first."""
    requests = [[1, c] for c in decodes] + ([[prefill_tokens, 0]] if prefill_tokens else [])
    return {"num_decodes": len(decodes), "num_prefill_tokens": prefill_tokens, "requests": requests}


def test_log_batches_picks_quartiles_of_long_decode_only_iterations(tmp_path):
    """Decode-only iterations of at least LOG_MIN_CONTEXT tokens, sorted by summed context
    (cached + 1 each); of the 6 that qualify, indexes round(0.25, 0.5, 0.75, 1.0 x 5) = 1, 2
    (Python rounds 2.5 to even), 4 and 5."""
    rows = [_record([40_000 * k, 59_999]) for k in (6, 1, 5, 2, 4, 3)]  # sums 40_000 k + 60_001, unsorted
    rows += [_record([90_000, 20_000], prefill_tokens=512),  # has a prefill: left out
             _record([5_000, 3_000]),  # too short
             {"num_decodes": 0, "num_prefill_tokens": 0, "requests": []}]  # nothing to decode
    path = tmp_path / "it.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    got = ba.log_batches(str(path))
    assert [sum(b) for b in got] == [40_000 * k + 60_001 for k in (2, 3, 5, 6)]
    assert got[0] == [80_001, 60_000]  # each decode's context: cached tokens + its new one


def test_log_batches_errors_and_empty(tmp_path):
    plain = tmp_path / "it.jsonl"
    plain.write_text(json.dumps(_record([1_000])) + "\n")
    assert ba.log_batches(str(plain)) == []  # none long enough
    plain.write_text("{not json\n")
    with pytest.raises(ValueError):
        ba.log_batches(str(plain))
    with pytest.raises(OSError):
        ba.log_batches(str(tmp_path / "missing.jsonl"))
