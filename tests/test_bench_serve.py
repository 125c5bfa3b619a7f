"""duetserve bench against a real ``duetserve serve`` on 127.0.0.1 (CPU, dummy weights).

The model is a 2-layer Llama with SmolLM2's shapes cut down (hidden 64) and SmolLM2's
tokenizer, so every run is fast on a CPU and prompts/outputs are real token ids and text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from duetserve.bench.cli import configure_parser, run
from duetserve.bench.launch import LaunchConfig, ServerProcess

pytest.importorskip("duetserve.server.api", reason="duetserve.server is not importable")
pytestmark = pytest.mark.slow

TRACE_DIRS = [Path(__file__).resolve().parents[1].parent / "shared" / "traces", Path("/work/shared/traces")]
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "architectures": ["LlamaForCausalLM"]}


@pytest.fixture(scope="module")
def tiny_llama(smollm_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config-only HF folder (tiny Llama, SmolLM2 vocabulary) with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    for f in smollm_folder.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    config = json.loads((smollm_folder / "config.json").read_text()) | TINY
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a running ``duetserve serve`` (stopped after the module)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = (f"{sys.executable} -m duetserve.cli serve --model {tiny_llama} --load-format dummy "
               f"--port {port} --device cpu --dtype float32 --log-level warning")
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(LaunchConfig(command, f"{url}/health", startup_timeout_s=300, log_path=log)):
        yield url


def bench(tmp_path: Path, argv: list[str]) -> dict:
    """Run ``duetserve bench`` with ``argv`` and return the saved result."""
    out = tmp_path / "result.json"
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    assert run(parser.parse_args(["--no-progress", "--result-file", str(out), *argv])) == 0
    return json.loads(out.read_text())


def check_complete(result: dict) -> None:
    """No failures, every metric key present, exact token counts, TTFT < E2EL."""
    assert result["failed"] == 0, result["failure_reasons"]
    assert result["completed"] == result["num_prompts"] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert isinstance(result[f"{stat}_{metric}_ms"], float)
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "request_goodput", "tbt_slo_attainment"):
        assert isinstance(result[key], float), key
    for r in result["requests"]:
        assert r["output_tokens"] == r["output_len"]
        assert 0 < r["ttft_s"] < r["e2el_s"]


def test_synthetic_run(server: str, tmp_path: Path) -> None:
    result = bench(tmp_path, ["--base-url", server, "--qps", "10", "--num-requests", "20",
                              "--input-len", "16:200", "--output-len", "4:32",
                              "--goodput", "ttft:2s", "--tbt-slo", "100ms"])
    check_complete(result)
    assert all(r["prompt_tokens"] == r["input_len"] for r in result["requests"])


def test_azure_code_window(server: str, tmp_path: Path) -> None:
    trace = next((d / "AzureLLMInferenceTrace_code.csv" for d in TRACE_DIRS
                  if (d / "AzureLLMInferenceTrace_code.csv").is_file()), None)
    if trace is None:
        pytest.skip("Azure code trace not found")
    result = bench(tmp_path, ["--base-url", server, "--trace", str(trace), "--window", "0:60",
                              "--max-input-len", "256", "--max-output-len", "16",
                              "--goodput", "e2el:10s", "--tbt-slo", "100ms"])
    check_complete(result)
    assert result["num_prompts"] > 50


def test_chat_prompts_exact_under_the_server_tokenizer(server: str, tiny_llama: Path,
                                                        tmp_path: Path) -> None:
    result = bench(tmp_path, ["--base-url", server, "--endpoint", "/v1/chat/completions",
                              "--tokenizer", str(tiny_llama), "--qps", "20", "--num-requests", "8",
                              "--input-len", "8:300", "--output-len", "4", "--goodput", "ttft:2s",
                              "--tbt-slo", "100ms"])
    check_complete(result)
    # The chat template adds the same number of tokens to every message.
    assert len({r["prompt_tokens"] - r["input_len"] for r in result["requests"]}) == 1
