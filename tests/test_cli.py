"""``duetserve serve`` rejects bad flags before loading anything, naming the flag."""
from __future__ import annotations

import pytest

from duetserve.cli import main


@pytest.mark.parametrize("argv, flag", [
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--device", "tpu"], "--device"),
    (["--profile", "nosuch"], "--profile"),
    (["--tbt-slo", "fast"], "--tbt-slo"),
    (["--tbt-slo=-5ms"], "--tbt-slo"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--policy", "pdmux", "--device", "cpu"], "--policy"),
    (["--libsmctrl", "/nonexistent.so"], "--libsmctrl"),
])
def test_bad_serve_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu", *argv] if "--device" not in argv else ["serve", *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
