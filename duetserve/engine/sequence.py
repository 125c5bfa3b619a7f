"""A request's token state as the scheduler sees it (no tensors, no text)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from duetserve.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request: its prompt and output token ids, KV blocks and progress.

    ``token_ids`` holds the prompt followed by the generated tokens. ``num_computed_tokens``
    counts the leading tokens whose keys/values are in the KV cache; the tokens after it are
    the next iteration's query tokens. After preemption it returns to 0 (recompute).

    Attributes:
        seq_id: engine-unique id.
        token_ids: prompt + output token ids.
        num_prompt_tokens: length of the prompt, tokens.
        params: sampling parameters.
        arrival_time: seconds (engine clock) when the request arrived.
        eos_token_ids: token ids that end generation unless ``params.ignore_eos``.
        block_table: KV-cache block ids, in order.
        block_array: ``block_table`` as int32, valid up to ``len(block_table)`` (the
            ``BlockManager`` keeps both), so building a step's block tables copies arrays
            instead of walking Python lists (thousands of ids per long sequence).
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_array: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32), repr=False)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def block_ids(self) -> np.ndarray:
        """The valid part of ``block_array``: ``block_table`` as an int32 array (a view)."""
        return self.block_array[:len(self.block_table)]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the KV cache: the query length of the next full step."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """True when the next step feeds exactly the last sampled token (a decode step)."""
        n = len(self.token_ids)  # the scheduler asks this of every running sequence, every iteration
        return n > self.num_prompt_tokens and n - self.num_computed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def stopped_by_token(self) -> bool:
        """Finished by its last token: EOS (unless ignored) or one of ``stop_token_ids``."""
        return self.stopped_by_eos or (self.finish_reason == "stop" and self.num_output_tokens > 0
                                       and self.token_ids[-1] in self.params.stop_token_ids)

    @property
    def stopped_by_eos(self) -> bool:
        """Finished by an EOS token (checked before ``stop_token_ids``, as ``append_token`` does)."""
        return (self.finish_reason == "stop" and self.num_output_tokens > 0 and not self.params.ignore_eos
                and self.token_ids[-1] in self.eos_token_ids)

    def append_token(self, token_id: int, max_model_len: int) -> str | None:
        """Append a sampled token and return the finish reason it causes, if any.

        ``"stop"`` for EOS (unless ignored) or a stop token id, ``"length"`` for ``max_tokens``
        or the context limit ``max_model_len`` (tokens).
        """
        self.token_ids.append(token_id)
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in self.params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
