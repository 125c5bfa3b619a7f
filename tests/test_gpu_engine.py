"""On a CUDA GPU: the engine's greedy tokens equal transformers' on the same GPU (marker gpu)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from duetserve.config import EngineConfig
from duetserve.engine.engine import LLMEngine
from duetserve.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKENDS = [f.default for f in dataclasses.fields(EngineConfig) if f.name == "attention_backend"] and \
    ["torch", "triton"]


def hf_greedy_cuda(folder, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompts:
        x = torch.tensor([ids], device="cuda")
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("backend", BACKENDS or ["torch"])
@pytest.mark.parametrize("eager", [True, False])
def test_tiny_qwen3_on_gpu_equals_hf(tiny_qwen3_folder, backend, eager):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (3, 17, 40, 90, 129)]
    extra = {"attention_backend": backend} if BACKENDS else {}
    config = EngineConfig(model=str(tiny_qwen3_folder), device="cuda", dtype="float32", max_num_batched_tokens=64,
                          num_kv_blocks=128, block_size=16, max_num_seqs=8, enforce_eager=eager, **extra)
    engine = LLMEngine(config)
    if not eager and backend == "triton":
        assert engine.graphs is not None
    assert (engine.piecewise is None) == eager
    replayed = []  # token counts of the batches replayed from piecewise graphs
    if not eager:  # the 64-token budget caps the default 1024
        assert engine.piecewise.buckets == [16, 32, 64]
        run = engine.piecewise.run
        engine.piecewise.run = lambda ids, *rest: replayed.append(ids.shape[0]) or run(ids, *rest)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, params) == hf_greedy_cuda(tiny_qwen3_folder, prompts, 24)
    assert eager or replayed[0] == 64  # the first iteration: the budget's worth of prompt tokens


def test_multi_step_decode_on_gpu_equals_hf(tiny_qwen3_folder):
    """``num_decode_steps=6``: decode-only iterations queue 6 graph replays one behind the other
    (inputs uploaded from pinned memory while the GPU works); greedy tokens equal transformers'."""
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (5, 33, 70)]
    config = EngineConfig(model=str(tiny_qwen3_folder), device="cuda", dtype="float32", max_num_batched_tokens=256,
                          num_kv_blocks=128, block_size=16, max_num_seqs=8, attention_backend="triton",
                          num_decode_steps=6)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    steps, stats = [], []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        steps.append(engine.last_stats.decode_steps)
        stats.append(engine.last_stats)
    assert [outputs[str(i)] for i in range(len(prompts))] == hf_greedy_cuda(tiny_qwen3_folder, prompts, 20)
    assert steps == [0, 6, 6, 6, 1]  # the prefill iteration (no decode), then 19 tokens in 6 + 6 + 6 + 1
    # temporal iterations (the prefill, the last single step) carry their GPU span, inside their wall time
    assert [set(s.stream_s) for s in stats[:1] + stats[-1:]] == [{"gpu"}, {"gpu"}]
    assert all("gpu" not in s.stream_s and s.stream_s["decode"] > 0 for s in stats[1:-1])  # the multi-step ones
    assert all(0 < s.stream_s["gpu"] < s.duration_s for s in (stats[0], stats[-1]))


def test_eager_decode_attention_compiles_nothing_after_start(tiny_qwen3_folder):
    """The engine compiles every eager decode attention variant at start
    (``TritonAttention.compile_decode_variants``): decode calls over every decode count and block
    table width then compile nothing. Compiled on first use, each variant held a served iteration
    1-2 s (docs/benchmarks.md, twenty-third session)."""
    import duetserve.model.triton_attention as ta

    config = EngineConfig(model=str(tiny_qwen3_folder), device="cuda", dtype="bfloat16", num_kv_blocks=128,
                          block_size=16, max_num_seqs=40, enforce_eager=True, attention_backend="triton")
    engine = LLMEngine(config)
    kernel = ta._paged_attention_kernel

    def variants() -> int:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    compiled = variants()
    k_cache, v_cache = engine.runner.kv_caches[0]
    heads, dim = engine.model.dims.num_heads, engine.model.dims.head_dim
    for n in range(1, 41):
        for width in (1, 2, 5, 9, 17, 33, 65, 128):
            q = torch.randn(n, heads, dim, dtype=torch.bfloat16, device="cuda")
            tables = torch.zeros(n, width, dtype=torch.int32, device="cuda")
            lens = torch.full((n,), width * 16, dtype=torch.int32, device="cuda")
            ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, 1.0, counters=engine.runner.split_counters)
    assert variants() == compiled
    assert not engine.runner.split_counters.any()


def test_kv_cache_beyond_free_gpu_memory_is_refused(tiny_qwen3_folder):
    """``--num-kv-blocks`` asking for more than CUDA's free memory is refused before anything is
    allocated, naming the flag and both sizes (the tiny model's blocks: 2 layers x K and V x 16
    tokens x 2 KV heads x 32 dims x 4 bytes = 16 KiB a block)."""
    blocks = 2 ** 40 // (16 << 10)  # 1 TiB of blocks, more than any GPU's memory
    config = EngineConfig(model=str(tiny_qwen3_folder), device="cuda", dtype="float32", num_kv_blocks=blocks,
                          block_size=16, max_num_seqs=8)
    free = torch.cuda.mem_get_info()[0] / 2**30
    with pytest.raises(ValueError) as info:
        LLMEngine(config)
    assert str(info.value).startswith(f"--num-kv-blocks {blocks}: the KV cache needs 1024.0 GiB, more than the ")
    assert abs(float(str(info.value).split("than the ")[1].split(" GiB")[0]) - free) < 2, (str(info.value), free)


def test_largest_batch_runs_at_start_and_fails_cleanly_without_memory(tiny_qwen3_folder, caplog):
    """The engine runs its largest iteration at start-up (``run_largest_batch``: here 65,536
    tokens over 256 prompts of 256, float32). Its peak is at least the MLP's gate/up output,
    65,536 x 2 x 128 x 4 bytes = 64 MiB. With the GPU's memory taken by other tensors it runs
    out of memory, and the engine then still serves: greedy tokens equal transformers'."""
    config = EngineConfig(model=str(tiny_qwen3_folder), device="cuda", dtype="float32",
                          max_num_batched_tokens=65536, max_num_seqs=256, num_kv_blocks=256, block_size=16)
    with caplog.at_level(logging.INFO, logger="duetserve.engine.engine"):
        engine = LLMEngine(config)
    assert [m for m in caplog.messages if m.startswith("the largest iteration (65536 tokens over 256 prompts) took ")]
    assert engine.max_model_len == 512
    tokens, prompts, peak = engine.runner.run_largest_batch(65536, 256, 512)
    assert (tokens, prompts) == (65536, 256) and peak >= 65536 * 2 * 128 * 4
    fillers = []
    try:
        torch.cuda.empty_cache()
        size = torch.cuda.mem_get_info()[0]
        while size >= 1 << 20:
            try:
                fillers.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                size //= 2
        with pytest.raises(torch.OutOfMemoryError):
            engine.runner.run_largest_batch(65536, 256, 512)
    finally:
        fillers.clear()
        torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 60)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, params) == hf_greedy_cuda(tiny_qwen3_folder, prompts, 12)
