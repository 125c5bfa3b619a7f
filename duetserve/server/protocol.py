"""OpenAI request bodies (pydantic) and their mapping to ``SamplingParams``."""
from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from duetserve.sampling import ParamError, SamplingParams

log = logging.getLogger(__name__)


def _json_number(kind: str):
    """A before-validator refusing what pydantic's lax mode would coerce into a number but OpenAI
    refuses: booleans (``true`` is not 1) and strings (``"5"``)."""
    def check(value: Any) -> Any:
        if isinstance(value, (bool, str)):
            raise PydanticCustomError(f"{kind}_type", f"Input should be a valid {kind}, not a "
                                      f"{'boolean' if isinstance(value, bool) else 'string'}")
        if kind == "integer" and isinstance(value, float) and not -2**63 <= value < 2**63:
            # pydantic says "Unable to parse input string as an integer, exceeded maximum size"
            raise PydanticCustomError("int_type", f"Input should be an integer in [-2**63, 2**63), got {value:g}")
        return value
    return BeforeValidator(check)


def _one_of(expected: str):
    """A wrap-validator for a union field: one message naming what the field takes, instead of
    pydantic's first error for its first member (e.g. "Input should be a valid string (prompt.str)")."""
    def validate(value: Any, handler) -> Any:
        try:
            return handler(value)
        except ValueError:  # pydantic's ValidationError
            raise PydanticCustomError("union_type", f"Input should be {expected}") from None
    return WrapValidator(validate)


# JSON integers and numbers as OpenAI takes them (no booleans, no numeric strings).
Int = Annotated[int, _json_number("integer")]
Float = Annotated[float, _json_number("number")]


def _nulls_as_defaults(model: type[BaseModel], data: Any) -> Any:
    """``data`` without the JSON ``null``s of ``model``'s own fields: a null for a known field
    means its default, as in OpenAI and vLLM (clients send e.g. ``"temperature": null``), and the
    field is then validated as if left out."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None or k not in model.model_fields}
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown keys are named in the request's warning
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (not only the last)
    continuous_usage_stats: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return _nulls_as_defaults(cls, data)


# OpenAI and vLLM fields this server does not implement, with the values that ask for nothing (a
# client library may send those); any other value is refused with HTTP 400 rather than ignored.
# (``logprobs``: 0 is not off for /v1/completions, where it asks for the sampled tokens' logprobs;
# ``prompt_logprobs``: 0 asks for the prompt tokens' logprobs.)
# Chat: vLLM's ``echo``, ``add_generation_prompt``, ``continue_final_message``, ``chat_template``
# and ``documents`` change the prompt, so they are refused unless at their defaults too.
# ``add_special_tokens``: vLLM's default is true for /v1/completions, false for chat (see
# ``_CHAT_UNSUPPORTED``).
_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_p": (None, 0), "logit_bias": (None, {}), "suffix": (None, ""), "min_tokens": (None, 0),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    "echo": (None, False), "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None, []),
    # vLLM's sampling and output extensions
    "use_beam_search": (None, False), "length_penalty": (None, 1), "allowed_token_ids": (None, []),
    "bad_words": (None, []), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "add_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False), "priority": (None, 0),
    "logits_processors": (None, []), "prompt_embeds": (None,),
    # OpenAI's audio output
    "modalities": (None, ["text"]), "audio": (None,),
}
# OpenAI request fields that change nothing a server generates (bookkeeping for OpenAI's own
# platform, or ``parallel_tool_calls`` without tools, which are refused above): accepted
# without the warning other unknown fields get, as the official SDK and agent frameworks send them.
_QUIET = frozenset({"store", "metadata", "service_tier", "parallel_tool_calls", "request_id"})
_CHAT_UNSUPPORTED = {**_UNSUPPORTED, "add_special_tokens": (None, False)}


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI + vLLM extensions). Other
    fields are ignored, with a warning unless in ``_QUIET`` (e.g. ``store``), except those in
    ``_UNSUPPORTED`` when they ask for something (``sampling_params`` refuses them)."""

    model_config = ConfigDict(extra="allow")
    _unsupported: ClassVar[dict[str, tuple]] = _UNSUPPORTED

    model: str | None = None
    max_tokens: Int | None = None
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = -1
    seed: Int | None = None
    stop: Annotated[str | list[str] | None, _one_of("a string or a list of strings")] = None
    stop_token_ids: list[Int] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    n: Int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # OpenAI's end-user id: checked (a string), changes nothing

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return _nulls_as_defaults(cls, data)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Build and validate ``SamplingParams``.

        Raises:
            ParamError: a field is out of range or unsupported (``_UNSUPPORTED``).
        """
        if self.n != 1:
            raise ParamError("only n=1 is supported", "n")
        for name, value in (self.model_extra or {}).items():
            # an "off" value only in its own JSON type: true is not 1 (Python's True == 1)
            if name in self._unsupported and not any(
                    value == off and isinstance(value, bool) == isinstance(off, bool)
                    for off in self._unsupported[name]):
                raise ParamError(f"{name} is not supported by this server", name)
        ignored = sorted(set(self.model_extra or {}) - set(self._unsupported) - _QUIET)
        if self.stream_options is not None:
            ignored += sorted(f"stream_options.{name}" for name in self.stream_options.model_extra or {})
        if ignored:  # as vLLM warns
            log.warning("The following fields were present in the request but ignored: %s", ignored)
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options is only allowed when stream is true", "stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output)
        params.validate()
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: ``stream_options.continuous_usage_stats`` counts only with
        ``include_usage`` (as in vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is text, or token ids (a one-element list of either is accepted)."""

    prompt: Annotated[str | list[Int] | list[str] | list[list[Int]],
                      _one_of("a string, a list of token ids (integers), or a list holding one of either")]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; only an assistant message may leave ``content`` out or null, and a list
    of parts must hold at least one (OpenAI's rules)."""

    role: Literal["system", "user", "assistant", "developer", "tool"]
    name: str | None = None  # OpenAI's participant name; checked, not passed to the chat template
    content: Annotated[str | list[TextPart] | None,
                       _one_of('a string or a list of {"type": "text", "text": ...} parts')] \
        = Field(default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_required(cls, content, info: ValidationInfo):
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing", f"a {role} message needs content: a string or a list of text parts")
        if content == []:  # OpenAI's schema: an array of at least one part
            raise PydanticCustomError("too_short", "content is an empty list: give at least one text part")
        return content


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` overrides ``max_tokens``."""

    _unsupported: ClassVar[dict[str, tuple]] = _CHAT_UNSUPPORTED

    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as plain ``{"role", "content"}`` dicts for the tokenizer's chat template; a
    message's text parts joined by newlines, as vLLM joins them; ``developer`` becomes ``system``.

    Raises:
        ParamError: no messages.
    """
    if not messages:
        raise ParamError("messages must not be empty", "messages")
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or [])
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): ``prompt`` text, or chat ``messages`` as the chat template
    renders them for ``/v1/chat/completions``; exactly one of the two (the endpoint checks).

    ``add_special_tokens`` (default: true for a prompt, false for messages, as vLLM): whether the
    tokenizer adds its special tokens (e.g. BOS) to the text; ``add_generation_prompt`` (messages
    only): end with the assistant turn's opening, as chat completions do; ``return_token_strs``:
    also return each token's string."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): ``tokens``, token ids, back to text."""

    model: str | None = None
    tokens: list[Int]
