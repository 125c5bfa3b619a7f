"""SGLang PD-multiplexing rules against the worked numbers of the "PD multiplexing"
notebook (docs/design.md, "Sources")."""

import math

import pytest

from duetserve.planner.pdmux import (
    PdmuxConfig,
    choose_group,
    prefill_layers_per_round,
    split_levels,
    stream_groups,
)

H100_GROUPS = [(132, 0), (112, 20), (104, 28), (96, 36), (88, 44), (80, 52), (72, 60), (0, 132)]


def test_split_levels_h100_a100_h20():
    assert stream_groups(132, 9) == H100_GROUPS
    assert stream_groups(108, 8) == [(108, 0), (84, 24), (78, 30), (72, 36), (66, 42), (60, 48), (54, 54), (0, 108)]
    # H20 exercise: step 8, prefill >= 39 and decode >= 16 leave 40, 48, 56: three levels, five groups
    assert stream_groups(78, 9) == [(78, 0), (56, 22), (48, 30), (40, 38), (0, 78)]
    assert split_levels(78, 9, 6) == [(56, 22), (48, 30), (40, 38)]


@pytest.mark.parametrize("decode_bs, group", [(1, 1), (6, 1), (12, 2), (18, 3), (24, 4), (30, 5), (36, 6), (64, 6)])
def test_level_chosen_by_decode_batch_on_h100(decode_bs, group):
    assert choose_group(len(H100_GROUPS), decode_bs, has_prefill=True) == group


def test_whole_gpu_groups_and_the_divisor_exercise():
    n = len(H100_GROUPS)
    assert H100_GROUPS[choose_group(n, 32, has_prefill=False)] == (0, 132)
    assert H100_GROUPS[choose_group(n, 0, has_prefill=True)] == (132, 0)
    assert choose_group(n, 0, has_prefill=False) == 0
    assert H100_GROUPS[choose_group(n, 32, has_prefill=True)] == (80, 52)
    # 72:60 is first chosen at 36 decode requests with the default divisor ...
    assert min(bs for bs in range(1, 100) if choose_group(n, bs, True) == 6) == 36
    # ... and at 24 with decode_bs_divisor = 24
    cfg = PdmuxConfig(decode_bs_divisor=24)
    assert min(bs for bs in range(1, 100) if choose_group(n, bs, True, cfg) == 6) == 24
    # on the H20's three levels, the same formula spreads over 3
    assert [choose_group(5, bs, True) for bs in (1, 12, 24, 36)] == [1, 1, 2, 3]


def test_manual_divisions():
    cfg = PdmuxConfig(sm_group_num=4, manual_divisions=((100, 32, 4), (76, 56, 24)))
    groups = stream_groups(132, 9, cfg)
    assert groups == [(132, 0), (100, 32), (76, 56), (0, 132)]
    picks = {bs: choose_group(len(groups), bs, True, cfg) for bs in (1, 4, 23, 24, 64)}
    assert picks == {1: 1, 4: 1, 23: 1, 24: 2, 64: 2}  # below every threshold: group 1
    assert choose_group(len(groups), 10, False, cfg) == 3
    with pytest.raises(ValueError):
        PdmuxConfig(sm_group_num=5, manual_divisions=((100, 32, 4),))
    with pytest.raises(ValueError):
        PdmuxConfig(sm_group_num=2)


@pytest.mark.parametrize("tokens, layers", [(512, 36), (8192, 8), (16384, 4), (32768, 2), (65536, 1), (131072, 1)])
def test_prefill_layers_per_round(tokens, layers):
    assert prefill_layers_per_round(tokens, 36) == layers


def test_long_prefill_takes_one_round_per_layer():
    # exercise 3: 131072 tokens, one layer a round, 36 rounds for a 36-layer model
    per_round = prefill_layers_per_round(131072, 36)
    assert math.ceil(36 / per_round) == 36
    assert prefill_layers_per_round(0, 36) == 36
    assert prefill_layers_per_round(1000, 36, PdmuxConfig(split_forward_token_budget=8192)) == 8


def test_unsupported_architecture_and_too_few_sms():
    with pytest.raises(ValueError):
        split_levels(132, 10, 6)
    with pytest.raises(ValueError):
        split_levels(24, 9, 6)
