"""Shared fixtures: the embedded SmolLM2 folder, a tiny random Qwen3 checkpoint, Triton's interpreter on CPU."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

CUDA = torch.cuda.is_available()
_triton_interpreted = False  # triton was first imported by import_triton_module, interpreted


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` (the scripts folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", Path(__file__).resolve().parent.parent /
                                                  "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def import_triton_module(name: str) -> ModuleType:
    """Import module ``name`` (it defines Triton kernels) so that without CUDA they run interpreted.

    Triton decides at definition time whether a jit function (its own library's too) is compiled
    or interpreted, so without CUDA ``TRITON_INTERPRET=1`` must be set before triton is first
    imported. Skips the calling test module when triton is missing, or was imported without it.
    """
    global _triton_interpreted
    interpreted = _triton_interpreted or os.environ.get("TRITON_INTERPRET") == "1"
    if not CUDA and "triton" in sys.modules and not interpreted:
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module; run it on its own",
                    allow_module_level=True)
    with pytest.MonkeyPatch.context() as mp:
        if not CUDA:
            mp.setenv("TRITON_INTERPRET", "1")
        pytest.importorskip("triton")
        _triton_interpreted = not CUDA
        return importlib.import_module(name)


@pytest.fixture(scope="module")
def triton_interpreter():
    """Keep ``TRITON_INTERPRET=1`` set (without CUDA) while a module's tests run, and only then."""
    with pytest.MonkeyPatch.context() as mp:
        if not CUDA:
            mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(scope="session")
def smollm_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted from GGUF to a cached HF folder."""
    from duetserve.model.loader import resolve_model

    try:
        folder, _ = resolve_model(None)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return folder


TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 320, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def tiny_qwen3_folder(tmp_path_factory) -> Path:
    """A random 2-layer Qwen3 (q/k norm, GQA, untied lm_head) saved as config.json + safetensors.

    The norm weights are randomised too, so a q/k-norm bug cannot hide behind all-ones weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    (folder / "config.json").write_text(json.dumps(TINY_QWEN3))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return folder


def run_counting_split_rounds(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], int]:
    """Run ``prompts`` on ``engine`` to the end; returns each one's output tokens and the number
    of iterations after which a layer-split (pdmux) prefill still had layers to run."""
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    unfinished = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        unfinished += not engine.runner.prefill_done
    return [outputs[str(i)] for i in range(len(prompts))], unfinished
