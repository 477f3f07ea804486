"""Request sets: random lengths, a JSONL prompt file, or groups sharing a prefix.

Prompt lengths are meant in *server* tokens.  With the byte-level tokenizer (refstack's)
one ASCII character is one token, so lengths are exact.  For a server with a
subword tokenizer, pass ``tokenizer="hf:<local path>"`` (needs ``transformers`` and a
tokenizer on disk; nothing is downloaded): prompts are then built from random token ids
and re-encoded until the count matches, as vLLM's random dataset does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from infra_agent.errors import ConfigError
from infra_agent.serving.client import RequestInput

# Lowercase letters and a space: one byte each, never merged or split by a byte tokenizer.
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte, like refstack's tokenizer."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer, loaded lazily and never from the network.

    ``transformers`` (the ``bench`` extra) is imported only here, so the benchmark
    does not need it unless a tokenizer is asked for.
    """

    def __init__(self, path: str, field: str = "tokenizer", file: str | None = None) -> None:
        folder = Path(path).expanduser()
        self.spec = f"hf:{path}"
        if not folder.is_dir():
            what = "a file, not a folder" if folder.exists() else "no such folder"
            raise ConfigError(file, field, "hf:<a local tokenizer folder> (tokenizer.json or tokenizer_config.json in it)",
                              f"{self.spec} ({what})")
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            raise ConfigError(file, field, f"a tokenizer folder holding one of {', '.join(_TOKENIZER_FILES)}",
                              f"{self.spec} (none of them in it)")
        # transformers warns at import that PyTorch is missing (a base install has none, and a
        # tokenizer needs none); the advice is noise in a benchmark's output.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError(file, field, "the transformers package for an hf: tokenizer (pip install 'infra-agent[bench]')",
                              self.spec) from exc
        try:
            self._tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # transformers raises many types for a corrupt folder
            raise ConfigError(file, field, "a tokenizer folder transformers can load", f"{self.spec} ({exc})") from exc
        self.vocab_size = int(self._tok.vocab_size)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def count_with_specials(self, text: str) -> int:
        """Tokens the server sees for a completion prompt: BOS and the like included."""
        return len(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


# A folder with one of these is a tokenizer transformers can load (fast, or slow with its vocab).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(spec: str | None, field: str = "tokenizer", file: str | None = None) -> Tokenizer:
    """``byte`` (or nothing) for refstack's byte tokenizer; ``hf:<local folder>`` for a server's own."""
    if spec in (None, "", "byte"):
        return ByteTokenizer()
    if spec.startswith("hf:") and spec[3:]:
        return HFTokenizer(spec[3:], field, file)
    raise ConfigError(file, field, "'byte' or 'hf:<local tokenizer folder>'", spec)


def tokenizer_id(tokenizer: Tokenizer | None) -> str:
    """What counted the prompt lengths: ``byte`` or ``hf:<path>``."""
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        return "byte"
    return str(getattr(tokenizer, "spec", None) or getattr(tokenizer, "name", type(tokenizer).__name__))


def random_text(tokenizer: Tokenizer, rng: np.random.Generator, n_tokens: int, whole_prompt: bool = False) -> tuple[str, int]:
    """A random prompt of ``n_tokens`` server tokens; returns (text, actual token count).

    With a Hugging Face tokenizer, as vLLM's random dataset: ids are drawn from the
    vocabulary less its special ids, decoded, and re-encoded until the count holds; a
    ``whole_prompt`` leaves room for the special tokens the server adds (a BOS), so the
    server sees ``n_tokens`` in all, and the count returned includes them.
    """
    if n_tokens <= 0:
        return "", 0
    if isinstance(tokenizer, ByteTokenizer):
        return rng.choice(_ALPHABET, size=n_tokens).tobytes().decode("ascii"), n_tokens
    allowed = _allowed_ids(tokenizer)
    specials = _specials_added(tokenizer) if whole_prompt else 0
    target = max(1, n_tokens - specials)
    ids = rng.choice(allowed, size=target).tolist()
    text = tokenizer.decode(ids)
    # Decoding then re-encoding can merge or split tokens; a few rounds of
    # truncate/pad converge for real tokenizers.
    for _ in range(4):
        enc = tokenizer.encode(text)
        if len(enc) == target:
            break
        if len(enc) > target:
            enc = enc[:target]
        else:
            enc = enc + rng.choice(allowed, size=target - len(enc)).tolist()
        text = tokenizer.decode(enc)
    return text, len(tokenizer.encode(text)) + specials


def _allowed_ids(tokenizer: Tokenizer) -> np.ndarray:
    cached = getattr(tokenizer, "_allowed", None)
    if cached is None:
        vocab = int(getattr(tokenizer, "vocab_size", 32000))
        special = set(getattr(getattr(tokenizer, "_tok", None), "all_special_ids", None) or [])
        cached = np.array([i for i in range(vocab) if i not in special], dtype=np.int64)
        try:
            tokenizer._allowed = cached  # type: ignore[attr-defined]
        except AttributeError:
            pass
    return cached


def _specials_added(tokenizer: Tokenizer) -> int:
    tok = getattr(tokenizer, "_tok", None)
    return int(tok.num_special_tokens_to_add()) if tok is not None and hasattr(tok, "num_special_tokens_to_add") else 0


def sample_lengths(rng: np.random.Generator, n: int, mean_len: int, range_ratio: float) -> np.ndarray:
    """Uniform integer lengths in [mean·(1−r), mean·(1+r)], at least 1 (vLLM's range ratio)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(None, "range_ratio", "a number in [0, 1)", range_ratio)
    lo = max(1, int(round(mean_len * (1 - range_ratio))))
    hi = max(lo, int(round(mean_len * (1 + range_ratio))))
    return rng.integers(lo, hi + 1, size=n)


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0, tokenizer: Tokenizer | None = None
) -> list[RequestInput]:
    tok = tokenizer or ByteTokenizer()
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, n, input_len, range_ratio)
    out_lens = sample_lengths(rng, n, output_len, range_ratio)
    reqs = []
    for i in range(n):
        text, actual = random_text(tok, rng, int(in_lens[i]), whole_prompt=True)
        reqs.append(RequestInput(prompt=text, prompt_len=actual, output_len=int(out_lens[i])))
    return reqs


def shared_prefix_requests(
    n: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
) -> list[RequestInput]:
    """``num_prefixes`` groups; requests cycle through them so each prefix recurs evenly."""
    if num_prefixes < 1:
        raise ConfigError(None, "num_prefixes", "an integer >= 1", num_prefixes)
    tok = tokenizer or ByteTokenizer()
    rng = np.random.default_rng(seed)
    prefixes = [random_text(tok, rng, prefix_len) for _ in range(num_prefixes)]
    reqs = []
    for i in range(n):
        ptext, plen = prefixes[i % num_prefixes]
        stext, slen = random_text(tok, rng, suffix_len)
        reqs.append(RequestInput(prompt=ptext + stext, prompt_len=plen + slen, output_len=output_len))
    return reqs


def jsonl_requests(
    path: str | Path,
    n: int,
    default_output_len: int = 128,
    prompt_field: str = "prompt",
    tokenizer: Tokenizer | None = None,
    seed: int = 0,
    start: int | None = None,
) -> list[RequestInput]:
    """Lines of ``{prompt_field: str}`` or ``{"messages": [...]}``; optional ``output_len``/``max_tokens``.

    With more requests than lines the file is cycled in a seeded shuffled order.  With
    ``start``, the lines are shuffled once (``seed``) and read as a ring from position
    ``start``: consecutive windows given starts ``k * n`` get disjoint prompts until the
    ring wraps (``serving/prompt_sets.py``); ``start=0`` with ``n`` <= lines is the
    order without it.
    """
    tok = tokenizer or ByteTokenizer()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(p), None, "an existing JSONL prompt file", "no such file")
    rows: list[RequestInput] = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(str(p), f"line {lineno}", "a JSON object", line[:80]) from exc
        if not isinstance(obj, dict) or not (prompt_field in obj or "messages" in obj):
            raise ConfigError(str(p), f"line {lineno}", f"an object with {prompt_field!r} or 'messages'", line[:80])
        prompt = obj[prompt_field] if prompt_field in obj else obj["messages"]
        text = prompt if isinstance(prompt, str) else "\n".join(m.get("content", "") for m in prompt)
        out_raw = obj.get("output_len", obj.get("max_tokens", default_output_len))
        if not isinstance(out_raw, int) or out_raw < 1:
            raise ConfigError(str(p), f"line {lineno}: output_len", "a positive integer", out_raw)
        out = out_raw
        rows.append(RequestInput(prompt=prompt, prompt_len=len(tok.encode(text)), output_len=out))
    if not rows:
        raise ConfigError(str(p), None, "at least one prompt line", "an empty file")
    if start is None:
        order = np.random.default_rng(seed).permutation(max(n, len(rows))) % len(rows)
    else:
        order = np.random.default_rng(seed).permutation(len(rows))[(start + np.arange(n)) % len(rows)]
    return [rows[int(i)] for i in order[:n]]


def build_requests(dataset: Any, n: int, tokenizer: Tokenizer | None = None, seed_offset: int = 0) -> list[RequestInput]:
    """Requests for a workspace dataset spec (``RandomDataset`` / ``JsonlDataset`` / ``SharedPrefixDataset``).

    ``seed_offset`` gives warmup requests prompts distinct from the measured ones.
    """
    kind = dataset.kind
    if kind == "random":
        return random_requests(n, dataset.input_len, dataset.output_len, dataset.range_ratio, dataset.seed + seed_offset, tokenizer)
    if kind == "shared_prefix":
        return shared_prefix_requests(
            n, dataset.num_prefixes, dataset.prefix_len, dataset.suffix_len, dataset.output_len, dataset.seed + seed_offset, tokenizer
        )
    if kind == "jsonl":
        return jsonl_requests(dataset.path, n, dataset.output_len, dataset.prompt_field, tokenizer, seed_offset)
    if kind == "random_mm":
        from infra_agent.serving.mm_dataset import random_mm_requests

        return random_mm_requests(n, dataset.input_len, dataset.output_len, dataset.range_ratio,
                                  dataset.seed + seed_offset, dataset.base_items_per_request,
                                  dataset.num_mm_items_range_ratio, dataset.limit_mm_per_prompt,
                                  dataset.bucket_config, dataset.text_only_ratio, tokenizer)
    raise ConfigError(None, "dataset.kind", "random, jsonl, shared_prefix or random_mm", kind)
