"""The OpenAI request bodies the server accepts, and their translation to engine terms.

Models are strict (a string is not silently turned into a number) and ignore fields
the engine does not implement, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refstack.engine import SamplingParams
from refstack.server.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound="_Body")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator accepts
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False  # a vLLM extension: benchmarks use it to fix output lengths

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise bad_request("'stop' strings must not be empty", param="stop")
        return stops

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Body):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(raw: bytes, model: type[M]) -> M:
    try:
        data: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def sampling_params(body: _Body, prompt_len: int, max_seq_len: int, default_max_tokens: int | None,
                    prompt_param: str) -> SamplingParams:
    """Check the lengths against the context and build the engine's params."""
    if body.n != 1:
        raise bad_request("only n=1 is supported", param="n", code="unsupported_value")
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param=prompt_param)
    if prompt_len >= max_seq_len:
        raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, your "
                       f"prompt has {prompt_len} tokens, which leaves no room for a completion. Please "
                       f"reduce the length of the prompt.", param=prompt_param, code="context_length_exceeded")
    requested = body.requested_max_tokens()
    param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    if requested is None:
        max_tokens = max_seq_len - prompt_len
        if default_max_tokens is not None:
            max_tokens = min(max_tokens, default_max_tokens)
    else:
        if requested <= 0:
            raise bad_request(f"'{param}' must be at least 1, got {requested}", param=param, code="invalid_value")
        if prompt_len + requested > max_seq_len:
            raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, you "
                           f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                           f"in the completion). Please reduce the length of the prompt or completion.",
                           param=param, code="context_length_exceeded")
        max_tokens = requested
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          seed=body.seed, stop=body.stop_strings(), ignore_eos=body.ignore_eos)
