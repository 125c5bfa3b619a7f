"""Incremental detokenization and stop-string handling for one request."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 5  # prompt tokens that give the first output token its context (e.g. a leading space)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    A fast tokenizer (one with a ``backend_tokenizer`` and no clean-up of spaces) decodes through
    the ``tokenizers`` library's ``DecodeStream``, one step a token, which holds an incomplete
    UTF-8 character back until a later token completes it (``add`` took 1.4 us a token against
    5.0 us with the window below, SmolLM2's tokenizer on a development CPU: at 128 running requests
    0.18 against 0.65 ms of host time a decode step). Any other tokenizer decodes a short window
    each step: the tokens from ``prefix_offset`` (already emitted, kept for context) to the end,
    minus the text of the window's emitted part, a delta ending in U+FFFD held back the same way.
    Both start from the prompt's last ``CONTEXT_TOKENS`` tokens. Stop strings end the text before
    the stop (after it with ``include_stop``); the last ``len(longest stop) - 1`` characters are
    held back until they cannot start one.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""     # all decoded output text
        self.emitted = 0   # characters of ``text`` already returned
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream: DecodeStream | None = None
        if self.backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self.stream = DecodeStream(skip_special_tokens=True)
            for t in self.ids:
                self.stream.step(self.backend, t)

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Add new tokens; return (text delta to emit, the stop string hit or None)."""
        if self.tokenizer is None:
            return "", None
        if self.stream is not None:
            for t in token_ids:
                if (chunk := self.stream.step(self.backend, t)) is not None:
                    self.text += chunk
            return self._flush(final=False)
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        window = self.tokenizer.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._flush(final=False)

    def _flush(self, final: bool) -> tuple[str, str | None]:
        # (end, start) of each stop string found; the one that ends first is the one generation
        # reached first, whatever the order of the list, and no other stop string lies wholly
        # before its end (one token may complete several: "-an" with stop ["n", "a"] is "-")
        hits = [(at + len(stop), at, stop) for stop in self.stop
                if (at := self.text.find(stop, max(0, self.emitted - len(stop) + 1))) != -1]
        if hits:
            end, start, stop = min(hits)
            self.text = self.text[:end if self.include_stop else start]
            return self._emit(len(self.text)), stop
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        return self._emit(end), None

    def finish(self) -> str:
        """Text held back for stop strings, released when the request ends."""
        return self._flush(final=True)[0]

    def _emit(self, end: int) -> str:
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta
