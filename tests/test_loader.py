"""The GGUF conversion cache of ``duetserve.model.loader``: keyed by content, shared by copies."""
from __future__ import annotations

import os

from duetserve.model import loader


def test_copies_of_one_gguf_share_a_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("DUETSERVE_CACHE", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path, mtime in ((first, 1_000_000_000), (second, 2_000_000_000)):  # two checkouts' copies
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
        os.utime(path, (mtime, mtime))
    key = loader._content_key(first)
    assert key == loader._content_key(second) and len(key) == 16
    cached = tmp_path / "cache" / "gguf" / f"m-{key}"
    cached.mkdir(parents=True)
    (cached / "model.safetensors").write_bytes(b"")  # a finished conversion: nothing is converted again
    assert loader.gguf_to_folder(first) == cached and loader.gguf_to_folder(second) == cached
    second.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)  # a changed file gets its own key
    assert loader._content_key(second) != key
