"""Deterministic prompts of an exact token length for benchmark requests.

Token-id prompts (for ``/v1/completions``) are exact by construction: one id per token, drawn
from ``token_id_range``. Text prompts (for ``/v1/chat/completions``) are made of common English
words separated by spaces. With a tokenizer, only words that are one token (with and without a
leading space) are used, and every prompt is checked, and trimmed or extended, until the
tokenizer counts exactly the requested length. Without a tokenizer, one word is taken as one
token: an approximation that holds for common words in GPT-2, Llama-3 and Qwen vocabularies.
For chat requests the requested length counts the user message's tokens; the server's chat
template adds its own fixed overhead, as in ``vllm bench serve``.

Requests with Mooncake ``hash_ids`` get the same leading blocks of
``MOONCAKE_BLOCK_TOKENS`` tokens whenever they share leading hash ids, so servers with prefix
caching see the trace's real reuse; the rest of each prompt is unique to the request.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from duetserve.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

COMMON_WORDS = tuple(
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an had they you were their one all we can her has there been if more when will "
    "would who so no time people year way day man thing woman life child world school state "
    "family student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money story fact "
    "month lot right study book eye job word business issue side kind head house service friend "
    "father power hour game line end member law car city name team minute idea kid body back".split()
)
"""Common English words used to build text prompts."""

_TEXT_FIX_ROUNDS = 8


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the prompt builder uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Token ids of ``text``."""
        ...


class PromptBuilder:
    """Builds the prompt of the i-th request of a run, reproducibly from a seed.

    Args:
        seed: seed; the same (seed, index, request) always gives the same prompt.
        token_id_range: ``(low, high)``: token-id prompts draw ids from ``[low, high)``.
        tokenizer: optional tokenizer that text prompts are checked against.

    Raises:
        ValueError: an empty ``token_id_range``, or a tokenizer under which fewer than 16 of
            the common words are single tokens.
    """

    def __init__(
        self, seed: int, token_id_range: tuple[int, int], tokenizer: Tokenizer | None = None
    ) -> None:
        low, high = token_id_range
        if not 0 <= low < high:
            raise ValueError(f"bad token id range [{low}, {high})")
        self.seed = seed
        self.token_id_range = token_id_range
        self.tokenizer = tokenizer
        self.words = COMMON_WORDS if tokenizer is None else self._single_token_words(tokenizer)

    @staticmethod
    def _single_token_words(tokenizer: Tokenizer) -> tuple[str, ...]:
        words = tuple(
            w
            for w in COMMON_WORDS
            if len(tokenizer.encode(w, add_special_tokens=False)) == 1
            and len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1
        )
        if len(words) < 16:
            raise ValueError(f"only {len(words)} common words are single tokens for this tokenizer")
        return words

    def _symbols(self, index: int, req: TraceRequest, alphabet: int, length: int) -> np.ndarray:
        """``length`` symbols in ``[0, alphabet)``: shared blocks for ``hash_ids``, then a
        stream unique to request ``index`` (also used to extend a prompt)."""
        blocks = [
            np.random.default_rng([self.seed, 1, h]).integers(0, alphabet, MOONCAKE_BLOCK_TOKENS)
            for h in req.hash_ids or []
        ]
        own = np.random.default_rng([self.seed, 2, index]).integers(0, alphabet, length)
        return np.concatenate([*blocks, own])[:length]

    def token_ids(self, index: int, req: TraceRequest) -> list[int]:
        """A prompt of exactly ``req.input_len`` token ids."""
        low, high = self.token_id_range
        return (low + self._symbols(index, req, high - low, req.input_len)).tolist()

    def text(self, index: int, req: TraceRequest) -> str:
        """A text prompt of ``req.input_len`` tokens (exact when a tokenizer is given).

        Raises:
            ValueError: the tokenizer's count could not be made exact.
        """
        n = req.input_len
        words = [self.words[s] for s in self._symbols(index, req, len(self.words), 2 * n)]
        if self.tokenizer is None:
            return " ".join(words[:n])
        size = n
        for _ in range(_TEXT_FIX_ROUNDS):
            text = " ".join(words[:size])
            count = len(self.tokenizer.encode(text, add_special_tokens=False))
            if count == n:
                return text
            size = min(len(words), max(1, size + n - count))
        raise ValueError(f"could not build a text prompt of exactly {n} tokens")
