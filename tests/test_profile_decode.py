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


def _load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("profile_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parse_shapes():
    parse = _load_script().parse_shapes
    assert parse("8x512, 32x2048") == ((8, 512), (32, 2048))
    for bad in ("8", "8x", "x512", "0x512", "8x-1", "8by512"):
        with pytest.raises(Exception, match="--shapes"):
            parse(bad)


@pytest.mark.skipif(CUDA, reason="checks the exit without CUDA")
def test_bad_shapes_named(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "8by512"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--shapes" in run.stderr and "Traceback" not in run.stderr
