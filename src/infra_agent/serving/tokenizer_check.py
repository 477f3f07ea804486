"""Does our tokenizer count prompts the way the server does?  Asked before the window.

Prompt lengths are only meaningful in the server's tokens.  With a local tokenizer
(``--tokenizer hf:PATH``) we check it against the server before any generation request:

1. ``POST /tokenize`` (vLLM; ``vllm bench serve`` uses it to align its prompts) or
   ``POST /v1/tokenize`` (SGLang): the server's token ids for one of our prompts must
   equal ours.
2. A server without ``/tokenize`` is checked on the first request's answer instead: its
   ``usage.prompt_tokens`` must equal our count with the special tokens the tokenizer
   adds (a BOS).  That request is the unmeasured check request, so a mismatch still
   stops the run before the window.

A mismatch is a ``TargetError`` naming the tokenizer, the prompt's two counts and the
first ids that differ: the prompts would have the wrong lengths, and every per-token
number with them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from infra_agent.errors import TargetError

if TYPE_CHECKING:
    from infra_agent.serving.client import RequestRecord
    from infra_agent.serving.datasets import HFTokenizer

IDS_EQUAL = "ids equal the server's /tokenize"
USAGE_EQUAL = "prompt_tokens of the first answer equal ours"
NOT_CHECKED = "not checked: the server has no /tokenize, and no completions usage to compare"

_SHOW = 8  # ids shown on each side of a mismatch


def _first_difference(ours: list[int], theirs: list[int]) -> int:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return min(len(ours), len(theirs))


async def server_tokens(client: aiohttp.ClientSession, base_url: str, model: str, text: str,
                        headers: Mapping[str, str] | None = None) -> list[int] | None:
    """The server's ids for ``text`` (no special tokens); None when it serves no tokenize endpoint.

    vLLM serves ``/tokenize``, SGLang ``/v1/tokenize``; both take
    ``{"model", "prompt", "add_special_tokens"}`` and answer ``{"tokens": [...], ...}``.
    """
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    for path in _TOKENIZE_PATHS:
        try:
            async with client.post(base_url.rstrip("/") + path, json=body, headers=headers) as resp:
                if resp.status != 200:
                    continue
                data: Any = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            continue
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
    return None


_TOKENIZE_PATHS = ("/tokenize", "/v1/tokenize")


def compare_ids(tokenizer_id: str, base_url: str, ours: list[int], theirs: list[int]) -> None:
    """Raise when the server's ids for a prompt differ from ours."""
    if ours == theirs:
        return
    i = _first_difference(ours, theirs)
    raise TargetError(
        f"tokenizer {tokenizer_id} does not fit the server at {base_url}: it encodes the check prompt as "
        f"{len(ours)} tokens, the server's /tokenize as {len(theirs)}; first difference at position {i} "
        f"(ours {ours[i:i + _SHOW]}, server's {theirs[i:i + _SHOW]}). Pass the tokenizer of the served model "
        f"(--tokenizer hf:PATH, or tokenizer: in the scenario)")


def compare_usage(tokenizer_id: str, base_url: str, expected: int, reported: int) -> None:
    """Raise when the server counted the check prompt differently from our tokenizer."""
    if expected == reported:
        return
    raise TargetError(
        f"tokenizer {tokenizer_id} does not fit the server at {base_url}: the check prompt is {expected} tokens "
        f"by it (special tokens included), but the server reported usage.prompt_tokens={reported} "
        f"(the server has no /tokenize to compare ids). Pass the tokenizer of the served model "
        f"(--tokenizer hf:PATH, or tokenizer: in the scenario)")


def _text(prompt: str | list[dict[str, str]]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


async def check_with_tokenize(client: aiohttp.ClientSession, base_url: str, model: str, tokenizer: HFTokenizer,
                              prompt: str | list[dict[str, str]], headers: Mapping[str, str] | None = None) -> str | None:
    """Step 1: compare ids with the server's ``/tokenize``; None when it has none."""
    text = _text(prompt)
    theirs = await server_tokens(client, base_url, model, text, headers)
    if theirs is None:
        return None
    compare_ids(tokenizer.spec, base_url, tokenizer.encode(text), theirs)
    return IDS_EQUAL


def check_with_usage(tokenizer: HFTokenizer, base_url: str, endpoint: str, prompt: str | list[dict[str, str]],
                     first: RequestRecord) -> str:
    """Step 2, without ``/tokenize``: the check request's ``usage.prompt_tokens`` against ours.

    Only a completions prompt can be counted here: a chat template adds tokens we
    cannot count without it, so a chat scenario on such a server stays unchecked.
    """
    if endpoint != "completions" or not first.success or first.usage_prompt_tokens is None or not isinstance(prompt, str):
        return NOT_CHECKED
    compare_usage(tokenizer.spec, base_url, tokenizer.count_with_specials(prompt), first.usage_prompt_tokens)
    return USAGE_EQUAL
