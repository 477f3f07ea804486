"""The typed form of ``infra-agent.yaml``: target, knobs, scenarios, criteria.

Every model forbids unknown keys.  Checks that need a field's neighbours (a
placeholder must be a declared knob, a criterion must name a scenario) raise
``DomainError`` with the sub-path, so the loader can report the exact field.
Load files with :func:`infra_agent.workspace.load_workspace`, which turns every
problem into a ``ConfigError`` naming file, field, expected and got.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from infra_agent.errors import ConfigError
from infra_agent.workspace import template
from infra_agent.workspace.knobs import MISSING, DomainError, Knob, KnobValue

RESERVED_PLACEHOLDERS = frozenset({"port"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- targets


class ServerTargetSpec(_Strict):
    """A server infra-agent launches itself, on a free loopback port."""

    kind: Literal["server"]
    # A list is an argv (no shell).  A string is split like a shell would, and runs
    # under /bin/sh only when it uses shell syntax (pipes, &&, $VAR ...).
    command: str | Annotated[list[str], Field(min_length=1)]
    # A path on the launched server (``/health``) or a full URL template.
    ready_url: str = "/health"
    metrics_url: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None  # relative to the workspace root
    ready_timeout_s: float = Field(300.0, gt=0)
    stop_grace_s: float = Field(10.0, gt=0)
    model: str | None = None  # the model name sent in requests

    @field_validator("env", mode="before")
    @classmethod
    def _env_scalars_as_text(cls, env: Any) -> Any:
        # YAML reads `OMP_NUM_THREADS: 4` as an int; the environment only holds text.
        if isinstance(env, dict):
            return {k: ("true" if v is True else "false" if v is False else str(v)) if isinstance(v, (int, float)) else v for k, v in env.items()}
        return env

    def templates(self) -> list[tuple[tuple[str | int, ...], str]]:
        """Every templated string with its sub-path, for placeholder checks."""
        out: list[tuple[tuple[str | int, ...], str]] = []
        if isinstance(self.command, str):
            out.append((("command",), self.command))
        else:
            out.extend((("command", i), part) for i, part in enumerate(self.command))
        out.append((("ready_url",), self.ready_url))
        if self.metrics_url is not None:
            out.append((("metrics_url",), self.metrics_url))
        out.extend((("env", k), v) for k, v in self.env.items())
        if self.cwd is not None:
            out.append((("cwd",), self.cwd))
        return out

    def missing_values(self, have: Collection[str]) -> list[tuple[tuple[str | int, ...], str]]:
        """Placeholders that ``have`` gives no value for, each with the field it sits in."""
        return [(sub, name) for sub, text in self.templates() for name in template.placeholders(text) if name not in have]


class EndpointTargetSpec(_Strict):
    """An already-running OpenAI-compatible server; requests go to ``{url}/v1/...``."""

    kind: Literal["endpoint"]
    url: str  # base URL, e.g. http://10.0.0.5:8000 (no /v1)
    ready_url: str | None = None  # if set, must answer 200 before a run
    metrics_url: str | None = None  # a path on ``url`` or a full URL
    model: str | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s]+", url):
            raise DomainError((), "an http:// or https:// base URL", url)
        return url.rstrip("/")


# A `python` kind (kernels) joins this union later.
Target = Annotated[ServerTargetSpec | EndpointTargetSpec, Field(discriminator="kind")]


# ---------------------------------------------------------------- scenarios


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


Dataset = Annotated[RandomDataset | JsonlDataset | SharedPrefixDataset, Field(discriminator="kind")]


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
    temperature: float = Field(0.0, ge=0)
    ignore_eos: bool = True


# ---------------------------------------------------------------- criteria

_HIGHER_BETTER = frozenset({"request_throughput", "output_throughput", "total_token_throughput", "request_goodput", "completed"})
_LOWER_BETTER = frozenset({"duration", "failed"})
_LATENCY = re.compile(r"^(mean|median|std|p\d+(\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")


def metric_direction(metric: str) -> Literal["higher", "lower"] | None:
    """Which way is better for a vLLM-style result key; None when unknown."""
    if metric in _HIGHER_BETTER:
        return "higher"
    if metric in _LOWER_BETTER or _LATENCY.match(metric):
        return "lower"
    return None


class Criterion(_Strict):
    """A gate: ``metric op ratio × baseline`` or ``metric op value``."""

    name: str
    metric: str
    scenario: str | None = None  # may be left out when there is one scenario
    op: Literal[">=", "<=", ">", "<"] | None = None  # defaults from the metric's direction
    ratio: float | None = Field(None, gt=0)
    value: float | None = None

    @model_validator(mode="after")
    def _one_threshold(self) -> Criterion:
        if (self.ratio is None) == (self.value is None):
            got = "both" if self.ratio is not None else "neither"
            raise DomainError((), "exactly one of `ratio` (relative to baseline) or `value` (absolute)", got)
        if self.op is None:
            direction = metric_direction(self.metric)
            if direction is None:
                raise DomainError(("op",), f"an explicit op (>=, <=, >, <), as metric {self.metric!r} has no known direction", MISSING)
            self.op = ">=" if direction == "higher" else "<="
        return self

    @property
    def relative(self) -> bool:
        return self.ratio is not None


# ---------------------------------------------------------------- workspace


class Workspace(_Strict):
    """A loaded ``infra-agent.yaml``; ``root`` is the folder that holds it."""

    name: str | None = None
    target: Target
    knobs: dict[str, Knob] = Field(default_factory=dict)
    scenarios: dict[str, Scenario] = Field(default_factory=dict)
    criteria: list[Criterion] = Field(default_factory=list)

    _root: Path = PrivateAttr(default_factory=Path.cwd)
    _source: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _cross_checks(self) -> Workspace:
        for knob_name in self.knobs:
            if not knob_name.isidentifier() or knob_name in RESERVED_PLACEHOLDERS:
                raise DomainError(("knobs", knob_name), "a knob name that is a Python identifier and not 'port'", knob_name)
        if isinstance(self.target, ServerTargetSpec):
            known = set(self.knobs) | RESERVED_PLACEHOLDERS
            for subpath, text in self.target.templates():
                try:
                    names = template.placeholders(text)
                except ValueError as exc:
                    raise DomainError(("target", *subpath), "a template with {name} placeholders ({{ for a literal brace})", str(exc)) from None
                for name in names:
                    if name not in known:
                        raise DomainError(("target", *subpath), f"placeholders among {{port}} and the declared knobs ({', '.join(sorted(self.knobs)) or 'none'})", "{" + name + "}")
        for i, crit in enumerate(self.criteria):
            if crit.scenario is None:
                if len(self.scenarios) != 1:
                    raise DomainError(("criteria", i, "scenario"), f"a scenario name (one of {sorted(self.scenarios)})", MISSING)
                crit.scenario = next(iter(self.scenarios))
            elif crit.scenario not in self.scenarios:
                raise DomainError(("criteria", i, "scenario"), f"one of the scenarios {sorted(self.scenarios)}", crit.scenario)
        return self

    @property
    def root(self) -> Path:
        return self._root

    @property
    def source(self) -> Path | None:
        """The ``infra-agent.yaml`` this was loaded from (None if built in code)."""
        return self._source

    def bind(self, root: Path, source: Path | None) -> Workspace:
        """Record where this workspace lives (the loader calls this)."""
        self._root = root
        self._source = source
        return self

    def scenario(self, name: str) -> Scenario:
        if name not in self.scenarios:
            raise ConfigError(self._file(), "scenarios", f"one of {sorted(self.scenarios)}", name)
        return self.scenarios[name]

    def resolve_knobs(self, overrides: Mapping[str, object] | None = None) -> dict[str, KnobValue]:
        """Defaults overlaid with ``overrides``; text values (``--set``) are parsed by type.

        Knobs without a default that are not overridden are left out.
        """
        values: dict[str, KnobValue] = {k: knob.default for k, knob in self.knobs.items() if knob.default is not None}
        for name, raw in (overrides or {}).items():
            knob = self.knobs.get(name)
            if knob is None:
                known = ", ".join(sorted(self.knobs)) or "none declared"
                raise ConfigError(self._file(), "knobs", f"a declared knob ({known})", name)
            try:
                values[name] = knob.parse(raw) if isinstance(raw, str) else knob.check(raw)
            except DomainError as exc:
                raise ConfigError(self._file(), f"knobs.{name}", exc.expected, raw) from None
        # A knob the launch command needs but that has no value would only fail at
        # launch time; say so now, where `validate` and `bench --set` can fix it.
        if isinstance(self.target, ServerTargetSpec):
            for subpath, name in self.target.missing_values({*values, *RESERVED_PLACEHOLDERS}):
                raise ConfigError(self._file(), f"knobs.{name}",
                                  f"a value for {{{name}}} in target.{'.'.join(map(str, subpath))} "
                                  f"(the knob has no default: pass --set {name}=...)", None)
        return values

    def _file(self) -> str:
        return str(self._source) if self._source else "<workspace>"
