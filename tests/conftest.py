"""Shared fixtures: the embedded SmolLM2 folder and a tiny random Qwen3 checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


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
