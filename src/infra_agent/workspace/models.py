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


class _Auth(_Strict):
    """Credentials for the target's HTTP API, shared by both target kinds."""

    # The NAME of an environment variable holding the server's API key (e.g. for
    # vLLM's --api-key); sent as ``Authorization: Bearer``, never stored.
    api_key_env: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)  # extra headers on every request

    @field_validator("api_key_env")
    @classmethod
    def _env_var_name(cls, name: str | None) -> str | None:
        if name is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise DomainError((), "the NAME of an environment variable holding the key (letters, digits, _), not the key", "a value that is not a name")
        return name

    @field_validator("headers")
    @classmethod
    def _header_names(cls, headers: dict[str, str]) -> dict[str, str]:
        for name in headers:
            if not re.match(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$", name):
                raise DomainError((name,), "an HTTP header name", name)
            if name.lower() == "authorization":
                raise DomainError((name,), "no Authorization header in the file (name the key's variable in api_key_env)", name)
        return headers


class ServerTargetSpec(_Auth):
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


class EndpointTargetSpec(_Auth):
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


# ---------------------------------------------------------------- criteria

_HIGHER_BETTER = frozenset({"request_throughput", "output_throughput", "total_token_throughput", "request_goodput", "completed"})
_LOWER_BETTER = frozenset({"duration", "failed"})
_LATENCY = re.compile(r"^(mean|median|std|p\d+(\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")


_COUNTS = frozenset({"total_input_tokens", "total_output_tokens"})  # result keys with no better direction
# Concrete latency keys offered as corrections (any pNN in (0, 100] is known).
_LATENCY_EXAMPLES = tuple(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                          for s in ("mean", "median", "std", "p50", "p90", "p95", "p99"))
METRIC_FORMS = ("request_throughput, output_throughput, total_token_throughput, request_goodput, completed, failed, "
                "duration, total_input_tokens, total_output_tokens, (mean|median|std|pNN)_(ttft|tpot|itl|e2el)_ms")


def metric_direction(metric: str) -> Literal["higher", "lower"] | None:
    """Which way is better for a vLLM-style result key; None when unknown."""
    if metric in _HIGHER_BETTER:
        return "higher"
    if metric in _LOWER_BETTER or _LATENCY.match(metric):
        return "lower"
    return None


def check_metric_direction(metric: str) -> Literal["higher", "lower"] | None:
    """Which way is better for a metric a shipped check probe reports (the quality probe's
    ``kl_div``, ``top1_agreement`` ...); None when no such probe reports it.  A criterion
    on such a metric names the check that measures it (``check:``)."""
    from infra_agent.judge.check_metrics import quality_metric_direction

    return quality_metric_direction(metric)


def known_metric(metric: str) -> bool:
    """Whether a serving benchmark result holds ``metric`` (``pNN`` with 0 < NN <= 100)."""
    if metric in _HIGHER_BETTER or metric in _LOWER_BETTER or metric in _COUNTS:
        return True
    m = _LATENCY.match(metric)
    if m is None:
        return False
    stat = m.group(1)
    return not stat.startswith("p") or 0 < float(stat[1:]) <= 100


def metric_suggestions(metric: str, n: int = 3) -> list[str]:
    """Known result keys close to a misspelled ``metric`` (best first)."""
    import difflib

    names = sorted(_HIGHER_BETTER | _LOWER_BETTER | _COUNTS) + list(_LATENCY_EXAMPLES)
    return difflib.get_close_matches(metric, names, n=n, cutoff=0.6)


class Criterion(_Strict):
    """A gate: ``metric op ratio × baseline`` or ``metric op value``."""

    name: str
    metric: str
    scenario: str | None = None  # may be left out when there is one scenario
    # The workspace check whose probe measures ``metric`` (the quality probe's ``kl_div``):
    # the criterion is then judged on that check's Feedback, not on a scenario's windows.
    check: str | None = None
    op: Literal[">=", "<=", ">", "<"] | None = None  # defaults from the metric's direction
    ratio: float | None = Field(None, gt=0)
    value: float | None = None
    # A metric that no benchmark result holds (a probe's own measurement): its name is
    # not checked, and ``op`` must be given.
    custom: bool = False

    @model_validator(mode="after")
    def _known_metric(self) -> Criterion:
        if self.check is not None or check_metric_direction(self.metric) is not None:
            return self  # a check's metric (Workspace._cross_checks pairs the two)
        if not self.custom and not known_metric(self.metric):
            close = metric_suggestions(self.metric)
            known = f"did you mean {close[0]!r}?" if close else f"one of {METRIC_FORMS}"
            raise DomainError(("metric",), f"a metric a benchmark result holds ({known}), or `custom: true` on the "
                              "criterion for a metric of your own", self.metric)
        return self

    @model_validator(mode="after")
    def _one_threshold(self) -> Criterion:
        if (self.ratio is None) == (self.value is None):
            got = "both" if self.ratio is not None else "neither"
            raise DomainError((), "exactly one of `ratio` (relative to baseline) or `value` (absolute)", got)
        if self.op is None:
            direction = metric_direction(self.metric) or check_metric_direction(self.metric)
            if direction is None:
                raise DomainError(("op",), f"an explicit op (>=, <=, >, <), as metric {self.metric!r} has no known direction", MISSING)
            self.op = ">=" if direction == "higher" else "<="
        return self

    @property
    def relative(self) -> bool:
        return self.ratio is not None


# ---------------------------------------------------------------- checks and guards


class CheckSpec(_Strict):
    """A cheap gate run before (and beside) end-to-end experiments.

    ``probe`` is a registered probe (``kernel``, ``command``) or a dotted path; its
    ``config`` is that probe's typed config, where any string may hold ``{knob}``
    placeholders, rendered with the configuration under test (so a kernel check can
    follow ``lm_head_precision``).  ``components`` say what it guards: the planner
    runs a check first when a change touches code or a related knob.
    """

    name: str = Field(min_length=1)
    probe: str = Field(min_length=1)
    config: dict[str, Any] = Field(default_factory=dict)
    components: list[str] = Field(default_factory=list)

    @field_validator("components")
    @classmethod
    def _known_components(cls, components: list[str]) -> list[str]:
        from infra_agent.vocabulary import check_component

        for i, component in enumerate(components):
            problem = check_component(component)
            if problem:
                raise DomainError((i,), problem, component)
        return components

    def placeholder_names(self) -> list[str]:
        return [n for _, text in _strings(self.config) for n in template.placeholders(text)]

    def render(self, knobs: Mapping[str, Any]) -> dict[str, Any]:
        """The config with every ``{knob}`` replaced by its value in ``knobs``."""
        from infra_agent.workspace.knobs import render_value

        values = {k: render_value(v) for k, v in knobs.items()}
        return _render_strings(self.config, values)


def _strings(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[tuple[str | int, ...], str]]:
    if isinstance(value, str):
        return [(path, value)]
    if isinstance(value, Mapping):
        return [x for k, v in value.items() for x in _strings(v, (*path, k))]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _strings(v, (*path, i))]
    return []


def _render_strings(value: Any, values: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return template.render(value, values)
    if isinstance(value, Mapping):
        return {k: _render_strings(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_render_strings(v, values) for v in value]
    return value


# Paths a change may never touch, whatever the workspace adds: the tests, the
# criteria and the harness that measure it.  This is the guard against an agent that
# "improves" a number by editing what measures it.
DEFAULT_PROTECTED: tuple[str, ...] = (
    "infra-agent.yaml", "infra-agent.yml", ".infra-agent/**", ".git/**",
    "tests/**", "test/**", "**/test_*.py", "**/*_test.py", "**/conftest.py",
    "bench/**", "benchmarks/**", "**/spec.py",
)


def _check_criterion(ws: Workspace, i: int, crit: Criterion) -> None:
    """A criterion judged on a check's Feedback: the check exists, and the gate is absolute."""
    checks = [c.name for c in ws.checks]
    if crit.check is None:
        raise DomainError(("criteria", i, "check"), f"the name of the workspace check that measures {crit.metric!r} "
                          f"(a quality probe check; checks: {', '.join(checks) or 'none declared'})", MISSING)
    if crit.check not in checks:
        raise DomainError(("criteria", i, "check"), f"one of the workspace checks {checks}", crit.check)
    if crit.scenario is not None:
        raise DomainError(("criteria", i, "scenario"), "no scenario on a criterion judged on a check", crit.scenario)
    if crit.ratio is not None:
        raise DomainError(("criteria", i, "ratio"), "an absolute `value` (a check criterion is judged on the candidate's "
                          "check alone; the quality probe already compares against its baseline server)", crit.ratio)


# ---------------------------------------------------------------- workspace


class Workspace(_Strict):
    """A loaded ``infra-agent.yaml``; ``root`` is the folder that holds it."""

    name: str | None = None
    target: Target
    knobs: dict[str, Knob] = Field(default_factory=dict)
    scenarios: dict[str, Scenario] = Field(default_factory=dict)
    criteria: list[Criterion] = Field(default_factory=list)
    checks: list[CheckSpec] = Field(default_factory=list)
    # Glob patterns (relative to the workspace root) a change may not touch, added to
    # DEFAULT_PROTECTED.
    protected: list[str] = Field(default_factory=list)

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
        names = [c.name for c in self.checks]
        for i, check in enumerate(self.checks):
            if names.count(check.name) > 1:
                raise DomainError(("checks", i, "name"), "a check name used once", check.name)
            for sub, text in _strings(check.config):
                try:
                    used = template.placeholders(text)
                except ValueError as exc:
                    raise DomainError(("checks", i, "config", *sub), "a template with {knob} placeholders", str(exc)) from None
                for name in used:
                    if name not in self.knobs:
                        raise DomainError(("checks", i, "config", *sub), f"placeholders among the declared knobs ({', '.join(sorted(self.knobs)) or 'none'})", "{" + name + "}")
        for i, crit in enumerate(self.criteria):
            if crit.check is not None or check_metric_direction(crit.metric) is not None:
                _check_criterion(self, i, crit)
                continue
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

    @property
    def protected_patterns(self) -> list[str]:
        return [*DEFAULT_PROTECTED, *self.protected]

    def check(self, name: str) -> CheckSpec:
        for c in self.checks:
            if c.name == name:
                return c
        raise ConfigError(self._file(), "checks", f"one of {[c.name for c in self.checks]}", name)
