"""Per-request sampling parameters (OpenAI/vLLM semantics)."""
from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_TEMPERATURE = 1e-5


class ParamError(ValueError):
    """A request parameter is invalid; ``param`` names it (for the OpenAI error body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole (an engine process sends it to the server)
        return type(self), (str(self), self.param)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: in [0, 2]; below ``GREEDY_TEMPERATURE`` (1e-5, vLLM's threshold) greedy.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 keeps all.
        seed: per-request seed; None draws from the engine's generator.
        stop: strings that end generation (not included in the output text unless
            ``include_stop_str_in_output``).
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating past EOS until ``max_tokens``.
        include_stop_str_in_output: end the text after the stop string that ended it, not
            before (vLLM's option of that name).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        """Argmax decoding: a temperature too small to sample with (it would overflow the
        logits in float32), or top-k 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self) -> None:
        """Raise ParamError naming the first invalid field."""
        if self.max_tokens < 1:
            raise ParamError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise ParamError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise ParamError(f"top_k must be -1, 0 or positive, got {self.top_k}", "top_k")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ParamError(f"seed must be in [0, 2**63), got {self.seed}", "seed")
        if any(not s for s in self.stop):
            raise ParamError("stop strings must not be empty", "stop")
        for s in self.stop:  # a lone surrogate could never match decoded text
            check_text(s, "stop")


def check_text(text: str, param: str) -> None:
    """Raise ParamError naming ``param`` when ``text`` is not valid Unicode (a lone surrogate
    cannot be encoded)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ParamError(f"{param} is not valid Unicode text: {exc.reason} at character {exc.start}", param) from None
