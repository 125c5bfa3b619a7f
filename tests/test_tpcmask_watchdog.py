"""The TPC-mask watchdog's sweep loop, with a fake child in place of the masked GEMMs."""
from __future__ import annotations

from conftest import load_script

FAKE_CHILD = r"""
import json, sys, time
for i, item in enumerate(json.loads(sys.argv[2])):
    if item[3] == "hang":
        time.sleep(60)
    if item[3] == "error":
        raise SystemExit("boom")
    print(i, flush=True)
"""


def test_sweep_marks_hangs_and_errors_and_resumes_after_them(monkeypatch):
    watchdog = load_script("tpcmask_watchdog")
    monkeypatch.setattr(watchdog, "CHILD", FAKE_CHILD)
    items = [(32, "decode", 1, name) for name in ("qkv", "hang", "o", "error", "down", "hang")]
    assert watchdog.sweep(items, timeout=0.5) == ["ok", "hang", "ok", "error: boom", "ok", "hang"]


def test_sweep_stops_when_the_child_cannot_start(monkeypatch):
    watchdog = load_script("tpcmask_watchdog")
    monkeypatch.setattr(watchdog, "CHILD", "raise SystemExit('no TPC masks here')")
    items = [(32, "decode", 1, "qkv"), (34, "prefill", 512, "o"), (36, "decode", 8, "down")]
    assert watchdog.sweep(items, timeout=0.5) == ["error: no TPC masks here"] * 3
