"""SGLang's PD-multiplexing rules (``--enable-pdmux``), as described in
the "PD multiplexing" notebook (docs/design.md, "Sources").

SGLang prepares a fixed list of stream groups ``(prefill SMs, decode SMs)`` at start-up:
group 0 gives every SM to prefill, the last group every SM to decode, and the groups in
between are green-context splits. While a prefill batch and decode requests coexist it picks
a split from the number of decode requests, and it runs the prefill a few layers per
scheduling round so each round stays short. These functions restate those rules so the
``pdmux`` policy can replay them; they hold no GPU state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Green-context split rule by compute capability major: (smallest part in SMs, SM step).
_GREEN_CTX_RULES = {6: (1, 1), 7: (2, 2), 8: (4, 2), 9: (8, 8)}
_MIN_DECODE_SMS = 16


@dataclass(frozen=True)
class PdmuxConfig:
    """SGLang's ``--pdmux-config-path`` fields.

    ``sm_group_num``: stream groups in all (>= 3), the two whole-GPU groups included.
    ``manual_divisions``: optional ``(prefill SMs, decode SMs, decode batch threshold)``
    rows, exactly ``sm_group_num - 2`` of them, replacing the computed splits; a row is used
    once the decode batch reaches its threshold (the last such row wins).
    ``split_forward_token_budget``: prefill tokens x layers per scheduling round.
    ``decode_bs_divisor``: decode batch size that maps to the last split level.

    Raises ValueError for sm_group_num < 3, a wrong number of manual rows, or a
    non-positive budget or divisor.
    """

    sm_group_num: int = 8
    manual_divisions: tuple[tuple[int, int, int], ...] = field(default_factory=tuple)
    split_forward_token_budget: int = 65536
    decode_bs_divisor: int = 36

    def __post_init__(self) -> None:
        if self.sm_group_num < 3:
            raise ValueError("sm_group_num must be >= 3")
        if self.manual_divisions and len(self.manual_divisions) != self.sm_group_num - 2:
            raise ValueError(f"manual_divisions needs {self.sm_group_num - 2} rows, got {len(self.manual_divisions)}")
        if self.split_forward_token_budget < 1 or self.decode_bs_divisor < 1:
            raise ValueError("split_forward_token_budget and decode_bs_divisor must be positive")


def split_levels(total_sms: int, cc_major: int, levels: int) -> list[tuple[int, int]]:
    """Green-context splits ``(prefill SMs, decode SMs)``, most prefill first.

    Candidates are prefill counts on the architecture's SM step (from its minimum part up
    to ``total_sms`` minus it) where prefill keeps at least half the SMs and decode gets at
    least 16. With at least ``levels`` candidates, every ``len // levels``-th one is taken,
    ``levels`` in all; otherwise all of them (H20's 78 SMs give only 3).

    Raises ValueError for a compute capability without a rule or when no split qualifies.
    """
    if cc_major not in _GREEN_CTX_RULES:
        raise ValueError(f"no green-context split rule for compute capability {cc_major}.x")
    smallest, step = _GREEN_CTX_RULES[cc_major]
    prefill = [p for p in range(smallest, total_sms - smallest + 1, step)
               if 2 * p >= total_sms and total_sms - p >= _MIN_DECODE_SMS]
    if not prefill:
        raise ValueError(f"no split of {total_sms} SMs gives prefill half and decode {_MIN_DECODE_SMS}")
    if len(prefill) >= levels:
        prefill = prefill[::max(1, len(prefill) // levels)][:levels]
    return [(p, total_sms - p) for p in reversed(prefill)]


def stream_groups(total_sms: int, cc_major: int, config: PdmuxConfig = PdmuxConfig()) -> list[tuple[int, int]]:
    """All stream groups ``(prefill SMs, decode SMs)``: whole GPU to prefill, the splits
    (``manual_divisions`` if given, else ``split_levels`` with ``sm_group_num - 2``
    levels), whole GPU to decode. Raises ValueError as ``split_levels``."""
    if config.manual_divisions:
        splits = [(p, d) for p, d, _ in config.manual_divisions]
    else:
        splits = split_levels(total_sms, cc_major, config.sm_group_num - 2)
    return [(total_sms, 0), *splits, (0, total_sms)]


def choose_group(num_groups: int, decode_bs: int, has_prefill: bool, config: PdmuxConfig = PdmuxConfig()) -> int:
    """Index of the stream group SGLang uses for this round.

    Decode only: the last group; prefill only (or nothing): group 0. Both: with
    ``manual_divisions``, the last row whose threshold ``decode_bs`` reaches (row i is
    group i + 1; below every threshold group 1, a case SGLang leaves undefined); otherwise
    ``decode_bs * levels // decode_bs_divisor`` clamped to 1..levels, where
    ``levels = num_groups - 2``.
    """
    levels = num_groups - 2
    if not (decode_bs and has_prefill):
        return num_groups - 1 if decode_bs else 0
    if config.manual_divisions:
        reached = [i + 1 for i, (_, _, threshold) in enumerate(config.manual_divisions) if decode_bs >= threshold]
        return reached[-1] if reached else 1
    return max(1, min(levels, decode_bs * levels // config.decode_bs_divisor))


def prefill_layers_per_round(prefill_tokens: int, num_layers: int, config: PdmuxConfig = PdmuxConfig()) -> int:
    """Layers of the prefill batch run per scheduling round:
    ``min(num_layers, max(1, split_forward_token_budget // prefill_tokens))``; all layers
    when the batch has no tokens (as SGLang does)."""
    if prefill_tokens <= 0:
        return num_layers
    return min(num_layers, max(1, config.split_forward_token_budget // prefill_tokens))
