"""The OpenAI request bodies the server accepts, and their translation to engine terms.

Every request parameter of OpenAI's two endpoints, and the vLLM sampling extensions
that clients commonly send, is in one of three classes, so none is dropped silently:

- implemented: a field of the model below, strictly typed (``"5"`` is not an int);
- ignored: it cannot change the answer (who is asking, where the answer is stored);
- rejected: not implemented.  Null or its neutral value (the one that means "off":
  ``n: 1``, ``frequency_penalty: 0``, ``tools: []``) is accepted; any other value is a
  400 with code ``unsupported_value`` that names the parameter.

``parameter_classes()`` lists them.  A field in none of the lists is ignored, as vLLM
does: clients send vendor extensions freely.

Strings must be valid Unicode: a lone surrogate (JSON ``"\\ud800"``, or its CESU-8
bytes, which Python's JSON decoder lets through) has no UTF-8 encoding, so the body is
refused with a 400 naming the field, rather than being encoded with a replacement.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refstack.engine import SamplingParams
from refstack.server.errors import APIError, bad_request, from_validation_error
from refstack.server.logprobs import MAX_LOGPROBS, LogprobParams

M = TypeVar("M", bound="_Body")

# The sampler works in float32: a temperature this small divides the logits into inf,
# and a top_p that rounds to 0 keeps no token, and either fails the engine's whole step.
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS); top_p is raised to
# this floor, which changes nothing (the best token's probability is >= 1/vocab, so any
# top_p up to that already keeps exactly the best token).
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6

# Rejected unless null or one of these values (compared as JSON: true is not 1).
_REJECTED_COMMON: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    # vLLM extensions
    "top_k": (-1, 0),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "prompt_logprobs": (),
    "include_stop_str_in_output": (False,),
    "stop_token_ids": ([],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
}
_REJECTED_COMPLETIONS: dict[str, tuple[Any, ...]] = {
    **_REJECTED_COMMON,
    "best_of": (1,),
    "suffix": ("",),
}
_REJECTED_CHAT: dict[str, tuple[Any, ...]] = {
    **_REJECTED_COMMON,
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools, both mean "answer in text"
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": (),
    # vLLM's chat extension (echo the last message); only completions echo here.
    "echo": (False,),
}


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: numbers compare by value (0 == 0.0), but a bool is no number."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    if isinstance(neutral, list):
        return isinstance(value, list) and len(value) == len(neutral) and all(map(_same, value, neutral))
    if isinstance(neutral, dict):
        return (isinstance(value, dict) and value.keys() == neutral.keys()
                and all(_same(value[k], neutral[k]) for k in neutral))
    return type(value) is type(neutral) and value == neutral


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # The endpoint's request parameters in OpenAI's API reference.
    OPENAI_PARAMETERS: ClassVar[tuple[str, ...]] = ()
    IGNORED: ClassVar[tuple[str, ...]] = ()
    REJECTED: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    model: str | None = None
    max_tokens: int | None = None
    # allow_inf_nan=False: a NaN compares false with every bound, so pydantic's range check
    # would answer `temperature: NaN` with "must be <= 2"; the message should say "finite".
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator accepts
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # a vLLM extension: benchmarks use it to fix output lengths

    @classmethod
    def parameter_classes(cls) -> dict[str, str]:
        """Every classified parameter: ``implemented``, ``ignored`` or ``rejected``."""
        out = {name: "implemented" for name in cls.model_fields}
        out.update({name: "ignored" for name in cls.IGNORED})
        out.update({name: "rejected" for name in cls.REJECTED})
        return out

    @classmethod
    def check_unsupported(cls, data: Mapping[str, Any]) -> None:
        for name, neutral in cls.REJECTED.items():
            value = data.get(name)
            if value is None or any(_same(value, v) for v in neutral):
                continue
            if isinstance(value, float) and not math.isfinite(value) and any(_is_number(v) for v in neutral):
                # NaN equals no neutral value, so it would be answered "set it to 0": what is
                # wrong with it is that it is no number, as for temperature and top_p.
                raise bad_request(f"'{name}': Input should be a finite number", param=name, code="invalid_value")
            allowed = " or ".join(json.dumps(v) for v in neutral)
            raise bad_request(f"'{name}' is not supported by refstack; leave it out, or set it to null"
                              + (f" or {allowed}" if allowed else ""), param=name, code="unsupported_value")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise bad_request("'stop' strings must not be empty", param="stop")
        return stops

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """How many alternatives to report per token; None when logprobs are off."""
        return None


class CompletionRequest(_Body):
    OPENAI_PARAMETERS: ClassVar[tuple[str, ...]] = (
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user")
    IGNORED: ClassVar[tuple[str, ...]] = ("user",)
    REJECTED: ClassVar[Mapping[str, tuple[Any, ...]]] = _REJECTED_COMPLETIONS

    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # The prompt comes back before the completion, and with ``logprobs`` its tokens'
    # teacher-forced logprobs (the first one null), as vLLM does; ``max_tokens: 0``
    # then returns the prompt's alone.
    echo: bool = False

    def logprob_count(self) -> int | None:
        return self.logprobs

    def check_echo(self, prompt_logprobs: bool) -> None:
        """400 for what refstack does not do with ``echo`` (``prompt_logprobs``: whether the
        engine can give prompt logprobs)."""
        if not self.echo:
            return
        if self.stream:
            raise bad_request("'echo' with 'stream': true is not supported by refstack; ask without streaming",
                              param="echo", code="unsupported_value")
        if self.logprobs is not None and not prompt_logprobs:
            raise bad_request("'echo' with 'logprobs' is not supported by this server (its engine cannot give "
                              "prompt logprobs: the disaggregated server, or a model without "
                              "forward_chunks_all_positions)", param="echo", code="unsupported_value")

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt alone."""
        return self.echo and self.max_tokens == 0


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    url: str
    detail: str | None = None  # OpenAI's resolution hint; one encoder resolution here


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # A string, or OpenAI's content parts: text, and images as data: URLs (refstack.encode).
    content: str | list[ContentPart]

    @property
    def has_parts(self) -> bool:
        return not isinstance(self.content, str)


class ChatCompletionRequest(_Body):
    OPENAI_PARAMETERS: ClassVar[tuple[str, ...]] = (
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
        "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls", "prediction",
        "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
        "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
        "top_logprobs", "top_p", "user", "verbosity", "web_search_options")
    # parallel_tool_calls only matters with tools, which are rejected.
    IGNORED: ClassVar[tuple[str, ...]] = ("user", "metadata", "store", "service_tier", "prompt_cache_key",
                                          "safety_identifier", "parallel_tool_calls")
    REJECTED: ClassVar[Mapping[str, tuple[Any, ...]]] = _REJECTED_CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_body(raw: bytes, model: type[M]) -> M:
    try:
        data: Any = json.loads(raw)
    except RecursionError:
        raise bad_request("request body is not valid JSON: nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    # Only escapes (\uD800) and CESU-8 bytes (ED A0..BF ..) can make a lone surrogate.
    if b"\\u" in raw or b"\xed" in raw:
        _reject_lone_surrogates(data)
    model.check_unsupported(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _reject_lone_surrogates(data: dict[str, Any]) -> None:
    """400 naming the first string (or key), in document order, that is not valid Unicode."""
    # (path of the parent, key or index, value); a path is only spelled out for the error.
    stack: list[tuple[str, Any, Any]] = [("", None, data)]
    while stack:
        parent, key, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                path = _join(parent, key)
                raise bad_request(
                    f"'{path}' contains a lone surrogate (U+{ord(value[exc.start]):04X} at index {exc.start}), "
                    "which is not valid Unicode; characters beyond U+FFFF need a surrogate pair",
                    param=path, code="invalid_value") from None
        elif isinstance(value, dict):
            path = _join(parent, key)
            children: list[tuple[str, Any, Any]] = []
            for k, v in value.items():
                children += [(path, k, k), (path, k, v)]  # a key is checked before its value
            stack.extend(reversed(children))
        elif isinstance(value, list):
            path = _join(parent, key)
            stack.extend((path, i, value[i]) for i in range(len(value) - 1, -1, -1))


def _join(parent: str, key: Any) -> str:
    if key is None:
        return parent
    part = key.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(key, str) else str(key)
    return f"{parent}.{part}" if parent else part


def sampling_params(body: _Body, prompt_len: int, max_seq_len: int, default_max_tokens: int | None,
                    prompt_param: str) -> SamplingParams:
    """Check the lengths against the context and build the engine's params."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param=prompt_param)
    if prompt_len >= max_seq_len:
        raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, your "
                       f"prompt has {prompt_len} tokens, which leaves no room for a completion. Please "
                       f"reduce the length of the prompt.", param=prompt_param, code="context_length_exceeded")
    requested = body.requested_max_tokens()
    param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    echo = bool(getattr(body, "echo", False))
    if requested is None:
        max_tokens = max_seq_len - prompt_len
        if default_max_tokens is not None:
            max_tokens = min(max_tokens, default_max_tokens)
    else:
        if requested < 0 or (requested == 0 and not echo):
            raise bad_request(f"'{param}' must be at least 1 (0 only with 'echo': true), got {requested}",
                              param=param, code="invalid_value")
        if prompt_len + requested > max_seq_len:
            raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, you "
                           f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
                           f"in the completion). Please reduce the length of the prompt or completion.",
                           param=param, code="context_length_exceeded")
        # echo with max_tokens 0: the engine still runs one step after the prompt (its
        # logits are the prompt's last); the route leaves that token out.
        max_tokens = max(requested, 1)
    temperature = body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature,
                              "top_p": max(body.top_p, MIN_TOP_P),
                              "seed": body.seed, "stop": body.stop_strings(), "ignore_eos": body.ignore_eos}
    count = body.logprob_count()
    if count is None:
        return SamplingParams(**kwargs)
    return LogprobParams(**kwargs, logprobs=count, prompt_logprobs=echo)
