"""Scenarios: the workloads under ``scenarios:`` in ``infra-agent.yaml``.

A :class:`Scenario` says what to send (its dataset: random, JSONL or shared-prefix
prompts), how many requests, how fast, and the goodput thresholds (:class:`Slo`) a
request must meet to count.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from infra_agent.workspace._base import _Strict
from infra_agent.workspace.goodput import GoodputSearch
from infra_agent.workspace.knobs import DomainError


class RandomDataset(_Strict):
    """Random token prompts of a fixed length band, like vLLM's ``random`` dataset."""

    kind: Literal["random"]
    input_len: int = Field(gt=0)
    output_len: int = Field(gt=0)
    # Lengths are drawn uniformly from [len*(1-r), len*(1+r)].
    range_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = 0
    vocab_size: int | None = Field(None, gt=0)  # hint; defaults to the tokenizer's


class JsonlDataset(_Strict):
    """One JSON object per line; the prompt is read from ``prompt_field``."""

    kind: Literal["jsonl"]
    path: Path  # relative to the workspace root; made absolute at load
    prompt_field: str = "prompt"
    output_len: int = Field(gt=0)

    @field_validator("path")
    @classmethod
    def _resolve(cls, path: Path, info: ValidationInfo) -> Path:
        root = (info.context or {}).get("root")
        if root is None:
            return path
        full = path if path.is_absolute() else Path(root) / path
        if not full.is_file():
            raise DomainError((), "an existing file (relative to the workspace root)", str(path))
        return full.resolve()


class SharedPrefixDataset(_Strict):
    """Prompts that share one of ``num_prefixes`` long prefixes (prefix-cache workloads)."""

    kind: Literal["shared_prefix"]
    prefix_len: int = Field(gt=0)
    suffix_len: int = Field(ge=0)
    output_len: int = Field(gt=0)
    num_prefixes: int = Field(1, gt=0)
    seed: int = 0


class RandomMMDataset(_Strict):
    """Random text plus seeded random images per request, like vLLM's ``random-mm``
    (serving/mm_dataset.py); ``text_only_ratio`` of the requests carry no image.  Sent
    as chat content parts: use ``endpoint: chat``."""

    kind: Literal["random_mm"]
    input_len: int = Field(gt=0)
    output_len: int = Field(gt=0)
    range_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = 0
    base_items_per_request: int = Field(1, ge=0)
    num_mm_items_range_ratio: float = Field(0.0, ge=0.0, le=1.0)
    limit_mm_per_prompt: int = Field(255, ge=0)
    # "HEIGHTxWIDTH": probability (vLLM's {(height, width, 1): probability}).
    bucket_config: dict[str, float] = Field(default_factory=lambda: {"256x256": 1.0})
    text_only_ratio: float = Field(0.0, ge=0.0, le=1.0)


Dataset = Annotated[RandomDataset | JsonlDataset | SharedPrefixDataset | RandomMMDataset, Field(discriminator="kind")]


class Slo(_Strict):
    """Goodput thresholds; a request counts only if it meets every one given."""

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2el_ms: float | None = Field(None, gt=0)


class Scenario(_Strict):
    """One workload: what to send, how many, how fast."""

    # request_rate may be inf; JSON has no infinity, so it is written as "Infinity".
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    dataset: Dataset
    num_requests: int = Field(gt=0)
    max_concurrency: int | None = Field(None, gt=0)
    request_rate: float = Field(math.inf, gt=0)  # req/s; inf sends all at once
    # Gamma shape of the inter-arrival gaps; 1.0 is Poisson, lower is burstier.
    burstiness: float = Field(1.0, gt=0)
    endpoint: Literal["completions", "chat"] = "completions"
    # The runner always sends at least one first request (it checks the endpoint
    # speaks the protocol before the window opens), so 0 behaves like 1.
    warmup_requests: int = Field(0, ge=0)
    slo: Slo | None = None
    # A goodput search (serving/goodput.py): the highest request rate meeting goodput.slo;
    # request_rate is then the search's to set.
    goodput: GoodputSearch | None = None
    # None sends no temperature (the server's default applies, as vLLM's client does); the
    # result records which (``sampling``).
    temperature: float | None = Field(0.0, ge=0)
    ignore_eos: bool = True
    # Each window of an experiment draws prompts of its own (serving/prompt_sets.py): a
    # prompt repeated across windows lets a server answer it from a cache of its earlier
    # answer, and flatters a prefix cache.  False sends the dataset's one set every window.
    fresh_prompts_per_window: bool = True
    # What counts prompt lengths: ``byte`` (refstack's), or ``hf:<folder>`` with the
    # served model's tokenizer (relative to the workspace root; made absolute at load).
    tokenizer: str | None = None

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_folder(cls, spec: str | None, info: ValidationInfo) -> str | None:
        if spec is None or spec == "byte":
            return spec
        if not spec.startswith("hf:") or not spec[3:]:
            raise DomainError((), "'byte' or 'hf:<tokenizer folder>'", spec)
        root = (info.context or {}).get("root")
        if root is None:
            return spec
        folder = Path(spec[3:]).expanduser()
        full = folder if folder.is_absolute() else Path(root) / folder
        if not full.is_dir():
            raise DomainError((), "hf:<an existing tokenizer folder> (relative to the workspace root)", spec)
        return "hf:" + str(full.resolve())
