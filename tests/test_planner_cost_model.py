"""Roofline cost model: hand-computed operator times, shapes, TP, modes and errors.

The hand cases use a made-up GPU with round numbers: 100 SMs, Pi(S) = 1e12 * S FLOP/s,
BW(S) = 2e10 * S bytes/s up to 50 SMs and 1e12 bytes/s from there, NVLink 1e11 bytes/s,
alpha 3 us; and a one-layer model: hidden 1024, 8 query heads, 2 KV heads, head_dim 128,
intermediate 4096, vocab 32000, bf16 (b = 2).
"""

from dataclasses import replace

import numpy as np
import pytest

from duetserve.planner.cost_model import CostModel, ModelShape
from duetserve.planner.hardware import load_profile, roofline_only, saturating_points

SHAPE = ModelShape(hidden=1024, layers=1, q_heads=8, kv_heads=2, head_dim=128, intermediate=4096, vocab=32000)


@pytest.fixture
def gpu():
    return replace(roofline_only(load_profile("h200")), name="round", num_sms=100, num_tpcs=50,
                   compute_points=saturating_points(1e14, 100, 100),
                   bandwidth_points=saturating_points(1e12, 50, 100), nvlink_bandwidth=1e11)


def test_one_linear_layer_by_hand(gpu):
    cm = CostModel(SHAPE, gpu)
    # lm_head is one linear, d_i = 1024, d_o = 32000.
    # 4 tokens on 100 SMs: F = 2*4*1024*32000 = 2.62144e8 FLOP -> 2.62144e-6 s at 1e14;
    # B = 2*(4*1024 + 1024*32000 + 4*32000) = 65,800,192 bytes -> 6.5800192e-5 s at 1e12: memory-bound.
    assert cm.predict([(1, 10)] * 4, 100).lm_head == pytest.approx(6.5800192e-5)
    # 1000 tokens on 10 SMs (Pi 1e13, BW 2e11): F = 6.5536e10 -> 6.5536e-3 s;
    # B = 2*(1,024,000 + 32,768,000 + 32,000,000) = 131,584,000 -> 6.5792e-4 s: compute-bound.
    assert cm.predict([(1000, 0)], 10, lm_head_tokens=1000).lm_head == pytest.approx(6.5536e-3)


def test_decode_attention_by_hand(gpu):
    cm = CostModel(SHAPE, gpu)
    # q=1, c=1023: pairs P = 1024; F = (4*128 + 2) * 8 * 1024 = 4,210,688 -> 4.21e-8 s at 1e14;
    # B = 2*128*(2*8*1 + 2*2*1024) = 1,052,672 bytes -> 1.052672e-6 s at 1e12: memory-bound.
    assert cm.predict([(1, 1023)], 100).attention == pytest.approx(1.052672e-6)
    # 10 SMs: BW = 2e11, five times slower.
    assert cm.predict([(1, 1023)], 10).attention == pytest.approx(5.26336e-6)
    # plus q=1, c=2047: B = 256*(16 + 8192) = 2,101,248 -> 2.101248e-6 s; the batch is the sum.
    assert cm.predict([(1, 1023), (1, 2047)], 100).attention == pytest.approx(3.15392e-6)


def test_prefill_attention_by_hand(gpu):
    cm = CostModel(SHAPE, gpu)
    # q=4096, c=0, causal pairs 4096*4097/2 = 8,390,656; F = 514 * 8 * 8,390,656 = 3.4502377472e10
    # -> 3.4502377472e-4 s; B = 256*(2*8*4096 + 2*2*4096) = 20,971,520 -> 2.1e-5 s: compute-bound.
    assert cm.predict([(4096, 0)], 100).attention == pytest.approx(3.4502377472e-4)
    # non-causal: P = 4096^2 = 16,777,216, F = 6.8987912192e10 FLOP.
    assert CostModel(SHAPE, gpu, causal=False).predict([(4096, 0)], 100).attention == pytest.approx(6.8987912192e-4)
    # chunked prefill q=1024 after c=3072: P = 1024*3072 + 1024*1025/2 = 3,670,528; F = 4112 * P.
    assert cm.predict([(1024, 3072)], 100).attention == pytest.approx(1.5093211136e-4)
    # per-request sum, not one roofline over the summed batch: decode + prefill
    mixed = cm.predict([(1, 1023), (4096, 0)], 100).attention
    assert mixed == pytest.approx(1.052672e-6 + 3.4502377472e-4)
    assert mixed > (4_210_688 + 3.4502377472e10) / 1e14


def test_attention_efficiency_scales_only_the_flops(gpu):
    cm = CostModel(SHAPE, replace(gpu, attention_efficiency=0.4, provenance={**gpu.provenance,
                                                                              "attention_efficiency": "measured"}))
    # prefill q=4096: F at 0.4 x 1e14 -> 3.4502377472e10 / 4e13 = 8.625594368e-4 s (B still 2.1e-5 s)
    assert cm.predict([(4096, 0)], 100).attention == pytest.approx(8.625594368e-4)
    # decode q=1, c=1023: F / 4e13 = 1.05e-7 s stays under B / BW = 1.052672e-6 s: unchanged
    assert cm.predict([(1, 1023)], 100).attention == pytest.approx(1.052672e-6)


def test_gemm_efficiency_scales_only_the_token_level_flops(gpu):
    cm = CostModel(SHAPE, replace(gpu, gemm_efficiency=0.8, provenance={**gpu.provenance, "gemm_efficiency": "measured"}))
    # lm_head over 1000 tokens on 10 SMs (test_one_linear_layer_by_hand): F = 6.5536e10 at 0.8 x 1e13 -> 8.192e-3 s
    assert cm.predict([(1000, 0)], 10, lm_head_tokens=1000).lm_head == pytest.approx(8.192e-3)
    # 4 tokens on 100 SMs: memory-bound, unchanged
    assert cm.predict([(1, 10)] * 4, 100).lm_head == pytest.approx(6.5800192e-5)
    # attention keeps Pi(S) x attention_efficiency (test_prefill_attention_by_hand)
    assert cm.predict([(4096, 0)], 100).attention == pytest.approx(3.4502377472e-4)


def test_norm_act_and_allreduce_by_hand(gpu):
    # 4 tokens, 100 SMs. Each RMSNorm: B = 2*(2*4*1024 + 1024) = 18,432 bytes -> 1.8432e-8 s;
    # SiLU-and-mul: B = 3*2*4*4096 = 98,304 bytes -> 9.8304e-8 s (FLOPs negligible).
    assert CostModel(SHAPE, gpu).predict([(4, 0)], 100).norm_act == pytest.approx(2 * 1.8432e-8 + 9.8304e-8)
    # TP=2: B_o = 4*1024*2 = 8192 bytes; one all-reduce = 2*3e-6 + 2*8192/(2*1e11) + 2*8192/1e14
    # = 6.08208384e-6 s; two per layer.
    bd = CostModel(SHAPE, gpu, tp=2).predict([(4, 0)], 100)
    assert bd.communication == pytest.approx(2 * 6.08208384e-6)
    assert CostModel(SHAPE, gpu).predict([(4, 0)], 100).communication == 0


def test_tp_splits_heads_and_weights(gpu):
    one, two = CostModel(SHAPE, gpu), CostModel(SHAPE, gpu, tp=2)
    # decode is memory-bound: half the weights and KV per GPU -> about half the linear/attention time
    reqs = [(1, 4095)] * 8
    assert two.predict(reqs, 100).attention == pytest.approx(one.predict(reqs, 100).attention / 2, rel=0.01)
    assert two.predict(reqs, 100).linear == pytest.approx(one.predict(reqs, 100).linear / 2, rel=0.01)
    with pytest.raises(ValueError, match=r"^tp=3: the model's 8 query heads and intermediate size 4096 are not "
                                         r"divisible by 3$"):
        CostModel(SHAPE, gpu, tp=3)


def test_tp_split_error_names_what_does_not_divide():
    assert SHAPE.tp_split_error(1) is None and SHAPE.tp_split_error(8) is None  # 2 KV heads < 8: replicated
    assert SHAPE.tp_split_error(16) == "8 query heads are not divisible by 16"
    qwen = ModelShape.preset("qwen3-8b")
    assert qwen.tp_split_error(3) == "32 query heads and 8 KV heads are not divisible by 3"
    assert ModelShape.preset("qwen3-14b").tp_split_error(5) == \
        "8 KV heads and intermediate size 17408 are not divisible by 5"
    assert replace(SHAPE, intermediate=4095).tp_split_error(2) == "intermediate size 4095 is not divisible by 2"


def test_lm_head_modes(gpu):
    reqs = [(100, 0), (1, 50)]
    last, every = CostModel(SHAPE, gpu), CostModel(SHAPE, gpu, lm_head="all")
    assert last.predict(reqs, 100).lm_head == pytest.approx(last.predict([(1, 0)] * 2, 100).lm_head)
    assert every.predict(reqs, 100).lm_head == pytest.approx(last.predict(reqs, 100, lm_head_tokens=101).lm_head)
    assert last.predict(reqs, 100, lm_head_tokens=0).lm_head == 0


def test_total_and_vectorised_prediction_agree():
    cm = CostModel(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")))
    reqs = [(1, c) for c in range(100, 6500, 100)] + [(2048, 4096), (512, 0)]
    sms = np.array([8, 16, 40, 64, 100, 132])
    totals = cm.predict_total(reqs, sms)
    assert totals.shape == (6,)
    for s, t in zip(sms, totals):
        assert cm.predict(reqs, int(s)).total == pytest.approx(t)
    assert np.all(np.diff(totals) < 0)  # more SMs, never slower on this curve
    assert cm.predict([], 132).total == 0


def test_qwen3_8b_decode_step_on_h200_is_weight_and_kv_bound():
    # 32 decodes of 2048 context on all 132 SMs: weights 2*(36*192,937,984 + 4096*151936) bytes
    # plus KV 32 * 2049 * 36 layers * 2 * 8 * 128 * 2 bytes over 4.037e12 bytes/s = 6.14 ms; activations
    # in and out of the linears (36 us) and norms (37 us) add 1.2%.
    cm = CostModel(ModelShape.preset("qwen3-8b"), roofline_only(load_profile("h200")))
    weights = 2 * (36 * 192_937_984 + 4096 * 151936)
    kv = 32 * 2049 * 36 * 2 * 8 * 128 * 2
    assert cm.predict([(1, 2048)] * 32, 132).total == pytest.approx((weights + kv) / 4.037e12, rel=0.015)


def test_model_shapes_from_config_and_presets():
    qwen = ModelShape.preset("qwen3-8b")
    assert (qwen.hidden, qwen.layers, qwen.q_heads, qwen.kv_heads, qwen.head_dim) == (4096, 36, 32, 8, 128)
    assert (qwen.intermediate, qwen.vocab, qwen.tie_embeddings) == (12288, 151936, False)
    assert ModelShape.preset("Qwen3-14B").hidden == 5120 and ModelShape.preset("qwen3-14b").layers == 40
    assert ModelShape.preset("llama3-8b").head_dim == 128  # hidden / heads when config has no head_dim
    smol = ModelShape.preset("smollm2-135m")
    assert (smol.head_dim, smol.kv_heads, smol.tie_embeddings) == (64, 3, True)
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 320}
    assert ModelShape.from_hf_config(cfg) == ModelShape(64, 2, 4, 4, 16, 128, 320, False)  # context unknown: None
    assert ModelShape.from_hf_config({**cfg, "max_position_embeddings": 2048}).max_positions == 2048
    assert (qwen.max_positions, ModelShape.preset("llama3-8b").max_positions, smol.max_positions) == (40960, 8192, 8192)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelShape.from_hf_config({k: v for k, v in cfg.items() if k != "vocab_size"})
    for key, value in (("num_hidden_layers", 0), ("num_hidden_layers", 1.5), ("hidden_size", -64), ("vocab_size", 0),
                       ("head_dim", 0), ("num_attention_heads", "4"), ("max_position_embeddings", 0)):  # 0 layers divided by zero in simulate
        with pytest.raises(ValueError, match=f"config '{key}' must be an integer >= 1, got {value!r}"):
            ModelShape.from_hf_config({**cfg, key: value})
    with pytest.raises(ValueError, match="'num_attention_heads' .4. must be a multiple of 'num_key_value_heads' .3."):
        ModelShape.from_hf_config({**cfg, "num_key_value_heads": 3})
    assert ModelShape.from_hf_config({**cfg, "num_key_value_heads": None, "head_dim": None}).kv_heads == 4
    with pytest.raises(ValueError):
        ModelShape.preset("gpt-5")


def test_bad_inputs_raise(gpu):
    cm = CostModel(SHAPE, gpu)
    for bad in (0, 101, -1):
        with pytest.raises(ValueError):
            cm.predict([(1, 10)], bad)
    with pytest.raises(ValueError):
        cm.predict([(0, 10)], 50)
    with pytest.raises(ValueError):
        cm.predict([(1, -1)], 50)
    with pytest.raises(ValueError):
        CostModel(SHAPE, gpu, lm_head="first")
    with pytest.raises(ValueError):
        CostModel(SHAPE, gpu, decode_margin=0.5)
    with pytest.raises(ValueError, match="prefill_scale must be positive"):
        CostModel(SHAPE, gpu, prefill_scale=0.0)


def test_spatial_prediction_applies_interference_and_margin():
    profile = roofline_only(load_profile("h200"))
    cm = CostModel(ModelShape.preset("qwen3-8b"), profile, decode_margin=1.1)
    dec, pre = [(1, 1000)] * 16, [(4096, 0)]
    t_d, t_p = cm.predict_spatial(dec, pre, np.array([32, 48]), 132)
    assert t_d[0] == pytest.approx(cm.predict(dec, 32).total * profile.decode_interference * 1.1)
    assert t_p[1] == pytest.approx(cm.predict(pre, 84).total * profile.prefill_interference)
