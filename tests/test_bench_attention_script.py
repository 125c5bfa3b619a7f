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


def test_make_inputs_scatters_the_blocks_over_a_server_sized_cache(monkeypatch):
    """``cache_tokens``: the cache holds that many tokens' blocks and the contexts' blocks are
    distinct ones spread over all of it; without it, exactly the blocks needed."""
    import torch

    monkeypatch.setattr(ba, "DEVICE", "cpu")
    torch.manual_seed(0)
    _, k_cache, v_cache, meta = ba.make_inputs([1, 1], [20, 40], cache_tokens=1600)
    assert k_cache.shape == v_cache.shape == (100, ba.BLOCK_SIZE, ba.HKV, ba.HEAD_DIM)
    used = torch.cat([meta.block_tables[0, :2], meta.block_tables[1, :3]])  # 20 and 40 tokens: 2 and 3 blocks
    assert len(set(used.tolist())) == 5
    assert int(used.max()) >= 5  # spread beyond the first 5 blocks (all 5 among them: 1 in 75 million)
    last = meta.block_tables[1, 2] * ba.BLOCK_SIZE + 39 % ba.BLOCK_SIZE  # the new token of context 40
    assert int(meta.slot_mapping[1]) == int(last)
    _, k_cache, _, meta = ba.make_inputs([1, 1], [20, 40])
    assert k_cache.shape[0] == 5
    assert sorted(meta.block_tables[0, :2].tolist() + meta.block_tables[1, :3].tolist()) == [0, 1, 2, 3, 4]


def test_baseline_module_and_its_columns(tmp_path, capsys):
    """``--baseline``: the file is imported as a module; its time and ours over it fill two
    columns, left out when no row has one; a missing file is a usage error naming the flag."""
    path = tmp_path / "old_attention.py"
    path.write_text("SPLITS = 3\n")
    assert ba.load_baseline(str(path)).SPLITS == 3
    rows = [{"base_us": 40.0, "us": 30.0}, {"base_us": None, "us": 10.0}]
    assert ba.base_header(rows).split() == ["base", "us", "x", "base"]
    assert ba.base_cells(rows[0]).split() == ["40.0", "0.75"]
    assert ba.base_header(rows[1:]) == ba.base_cells(rows[1]) == ""
    with pytest.raises(SystemExit) as exc:
        ba.main(["--baseline", str(tmp_path / "missing.py")])
    assert exc.value.code == 2 and "--baseline" in capsys.readouterr().err
