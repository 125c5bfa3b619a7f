"""OpenAI request bodies (pydantic) and their mapping to ``SamplingParams``."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from duetserve.sampling import ParamError, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI fields this server does not implement, with the values that ask for nothing (a client
# library may send those); any other value is refused with HTTP 400 rather than ignored.
_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "suffix": (None, ""), "min_tokens": (None, 0),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
}


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI + vLLM extensions). Other
    fields are ignored (e.g. ``user``), except those in ``_UNSUPPORTED`` when they ask for
    something (``sampling_params`` refuses them)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Build and validate ``SamplingParams``.

        Raises:
            ParamError: a field is out of range or unsupported (``_UNSUPPORTED``).
        """
        if self.n != 1:
            raise ParamError("only n=1 is supported", "n")
        for name, value in (self.model_extra or {}).items():
            if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
                raise ParamError(f"{name} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options is only allowed when stream is true", "stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)
        params.validate()
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, or token ids (a one-element list of either is accepted)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` overrides ``max_tokens``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages as plain ``{"role", "content"}`` dicts for the tokenizer's chat template.

        Raises:
            ParamError: no messages.
        """
        if not self.messages:
            raise ParamError("messages must not be empty", "messages")
        out = []
        for m in self.messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out
