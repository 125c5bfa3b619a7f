"""scripts/profile_decode.py (GPU kernel profile of decode steps) without CUDA: a message, exit code 2, no JSON."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CUDA

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile_decode.py"


@pytest.mark.skipif(CUDA, reason="checks the exit without CUDA")
def test_exits_cleanly_without_cuda(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()
