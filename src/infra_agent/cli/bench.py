"""``infra-agent bench URL|WORKSPACE``: one E2E serving benchmark, vLLM-compatible JSON.

URL mode takes the workload from flags.  WORKSPACE mode takes it from a scenario of
``infra-agent.yaml`` (flags given on the command line override it) and starts the
target server itself, with ``--set knob=value`` on top of the knob defaults.

Exit status: 0 for a good run; 1 when the run failed (the server died, its metrics
stopped answering, or more requests failed than ``--max-failed-fraction`` allows), with
the result still written; 2 on a user error.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

import typer
from pydantic import ValidationError
from rich.console import Console

from infra_agent.cli.bench_render import render_result
from infra_agent.cli.output import emit, user_errors
from infra_agent.errors import ConfigError, InfraAgentError, ServerStartError

# Only light modules at the top: `infra-agent bench --help` must not load aiohttp, numpy
# or httpx; the runner and the target package are imported when a benchmark runs.
from infra_agent.serving.results import (
    backend_name,
    failed_result,
    requests_path_for,
    result_filename,
    unique_path,
    workspace_record,
    write_result,
)
from infra_agent.workspace.models import Scenario

if TYPE_CHECKING:
    from infra_agent.serving.datasets import Tokenizer
    from infra_agent.serving.timing import LatencyDefinition

_URL = re.compile(r"^https?://", re.IGNORECASE)
LATENCY_DEFINITIONS = ("vllm", "content")  # as bench.timing; not imported, so --help stays light
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_target_text(target: str) -> None:
    """A URL with another scheme than http(s) is an error, not a workspace path."""
    m = _SCHEME.match(target)
    if m and not _URL.match(target):
        raise ConfigError(None, "TARGET", f"an http:// or https:// base URL, or a workspace folder (the scheme "
                          f"'{m.group(1)}://' is not supported)", target)


def base_url(url: str) -> str:
    """The server's base URL: a trailing ``/`` or ``/v1`` (as OpenAI clients take it) is dropped.

    Requests go to ``<base>/v1/...``; keeping a ``/v1`` would send them to ``/v1/v1/...``,
    a 404 with no hint.  The result's ``url`` is the base URL used.
    """
    url = url.rstrip("/")
    if url.lower().endswith("/v1"):
        url = url[:-3].rstrip("/")
    return url


def parse_sets(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in pairs:
        if "=" not in item:
            raise ConfigError(None, "--set", "knob=value", item)
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(None, "--percentiles", "comma-separated numbers in (0, 100], e.g. 50,90,99", text) from None
    if not values or not all(0 < p <= 100 for p in values):
        raise ConfigError(None, "--percentiles", "comma-separated numbers in (0, 100]", text)
    return values


def _scenario(data: dict[str, Any]) -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        from infra_agent.workspace.loader import expected_text

        # The scenario is built from flags: name the flag (``--num-requests``, ``--input-len``).
        flag = "--" + str([x for x in err["loc"] if isinstance(x, str)][-1]).replace("_", "-") if err["loc"] else None
        raise ConfigError("infra-agent bench", flag, expected_text(err), err.get("input")) from None


def _url_dataset(kind: str, input_len: int, output_len: int, range_ratio: float, path: Path | None,
                 prefix_len: int, num_prefixes: int, seed: int) -> dict[str, Any]:
    if kind == "random":
        return {"kind": "random", "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio, "seed": seed}
    if kind == "jsonl":
        if path is None:
            raise ConfigError(None, "--dataset-path", "a JSONL file for --dataset jsonl", None)
        return {"kind": "jsonl", "path": str(path), "output_len": output_len}
    if kind == "shared_prefix":
        return {"kind": "shared_prefix", "prefix_len": prefix_len, "suffix_len": input_len, "output_len": output_len,
                "num_prefixes": num_prefixes, "seed": seed}
    raise ConfigError(None, "--dataset", "random, jsonl or shared_prefix", kind)


class RunnerOptions(TypedDict):
    """What both modes hand their runner unchanged, checked before any server starts."""

    progress: bool
    percentiles: list[float]
    max_failed_fraction: float
    tokenizer: Tokenizer | None
    latency_definition: LatencyDefinition


def _runner_options(percentiles: str, latency_def: str, tokenizer: str | None, max_failed_fraction: float,
                    progress: bool) -> RunnerOptions:
    from infra_agent.serving.datasets import load_tokenizer

    pcts = parse_percentiles(percentiles)
    if latency_def not in LATENCY_DEFINITIONS:
        raise ConfigError(None, "--latency-def", f"one of {', '.join(LATENCY_DEFINITIONS)}", latency_def)
    # Before any server is started or request sent: a missing folder or a
    # missing transformers is the user's to fix.
    tok = load_tokenizer(tokenizer, "--tokenizer") if tokenizer is not None else None
    if not 0.0 <= max_failed_fraction <= 1.0:
        raise ConfigError(None, "--max-failed-fraction", "a fraction in [0, 1]", max_failed_fraction)
    return RunnerOptions(progress=progress, percentiles=pcts, max_failed_fraction=max_failed_fraction, tokenizer=tok,
                         latency_definition=cast("LatencyDefinition", latency_def))


@dataclass(frozen=True)
class UrlFlags:
    """The flags only URL mode reads: in workspace mode the scenario and target own them."""

    dataset: str | None
    input_len: int | None
    output_len: int | None
    range_ratio: float | None
    dataset_path: Path | None
    prefix_len: int | None
    num_prefixes: int | None
    seed: int | None
    model: str | None
    metrics_url: str | None
    api_key_env: str | None
    header: list[str]

    def given(self) -> list[str]:
        """The flags given on the command line, sorted."""
        flags = {"--dataset": self.dataset, "--input-len": self.input_len, "--output-len": self.output_len,
                 "--range-ratio": self.range_ratio, "--dataset-path": self.dataset_path, "--prefix-len": self.prefix_len,
                 "--num-prefixes": self.num_prefixes, "--seed": self.seed, "--model": self.model,
                 "--metrics-url": self.metrics_url, "--api-key-env": self.api_key_env, "--header": self.header or None}
        return sorted(flag for flag, v in flags.items() if v is not None)

    def dataset_config(self) -> dict[str, Any]:
        """The scenario's ``dataset``, with URL mode's defaults for what was not given."""
        return _url_dataset(self.dataset or "random", self.input_len or 128, self.output_len or 64, self.range_ratio or 0.0,
                            self.dataset_path, self.prefix_len or 256, self.num_prefixes or 1, self.seed or 0)


@dataclass
class _Attempt:
    """What is known of the run so far, filled in as each step succeeds: when the run
    fails before it has a result, the failed result is written from this."""

    scenario: Scenario | None = None
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _run_url(target: str, flags: UrlFlags, load: dict[str, Any], slo: dict[str, float], attempt: _Attempt,
             options: RunnerOptions, requests_path: Path | None) -> dict[str, Any]:
    from infra_agent.serving.runner import run_benchmark
    from infra_agent.target.auth import parse_header, request_headers

    given_url, target = target, base_url(target)
    if target != given_url.rstrip("/"):
        Console(stderr=True).print(f"bench: using the base URL {target} (requests go to {target}/v1/...)",
                                   markup=False, highlight=False)
    ds = flags.dataset_config()
    rest = dict(load)
    attempt.scenario = _scenario({"dataset": ds, "num_requests": rest.pop("num_requests", 100), "endpoint": "completions",
                                  "warmup_requests": 0, "temperature": 0.0, **rest, "slo": slo or None})
    headers = dict(parse_header(h) for h in flags.header)
    headers = request_headers(flags.api_key_env, headers, field="--api-key-env")
    if flags.api_key_env:
        attempt.extra["api_key_env"] = flags.api_key_env  # the name only
    return run_benchmark(target, attempt.scenario, model=flags.model, metrics_url=flags.metrics_url, headers=headers,
                         requests_path=requests_path, **options)


def _run_workspace(target: str, scenario: str | None, sets: list[str], flags: UrlFlags, load: dict[str, Any],
                   slo: dict[str, float], attempt: _Attempt, options: RunnerOptions,
                   requests_path: Path | None) -> dict[str, Any]:
    from infra_agent.serving.runner import only_scenario, run_workspace_scenario

    given = flags.given()
    if given:
        # The workspace scenario and target own these; silently ignoring them
        # would benchmark something other than what the user asked for.
        raise ConfigError(target, ", ".join(given), "no dataset/model/metrics/auth flags in workspace mode "
                          "(edit the scenario or target in infra-agent.yaml)", "given")
    # Here, not at the top: the probes package loads numpy, and --help stays light.
    from infra_agent.probes.workspace_checks import load_workspace

    ws = load_workspace(target)
    from infra_agent.extras import target_needs

    if (why := target_needs(ws.target)) is not None:  # a base install: name the extra, exit 2
        raise InfraAgentError(f"{ws.root / 'infra-agent.yaml'}: {why}")
    name = scenario or only_scenario(ws)
    base = ws.scenario(name)
    merged = {**base.model_dump(), **load, **({"slo": slo} if slo else {})}
    attempt.scenario = _scenario(merged) if (load or slo) else base
    attempt.model = ws.target.model
    attempt.extra["workspace"] = workspace_record(ws)
    return run_workspace_scenario(ws, name, parse_sets(sets), scenario=attempt.scenario,
                                  requests_path=requests_path, **options)


@dataclass(frozen=True)
class ResultDestination:
    """Where the result goes: ``-o FILE`` as given, or under ``--result-dir`` a file
    named after the run, once its model is known."""

    output: Path | None
    result_dir: Path | None
    # Known before the run, so a killed run leaves its per-request records; under
    # --result-dir they get a provisional name until the model is known.
    requests_path: Path | None

    @classmethod
    def from_flags(cls, output: Path | None, result_dir: Path | None) -> ResultDestination:
        if output is not None and result_dir is not None:
            raise ConfigError(None, "--output, --result-dir", "one of them (a file, or a folder to name the file in)", "both")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        requests_path = (requests_path_for(output) if output is not None else
                         result_dir / f"bench-{stamp}-{os.getpid()}.requests.jsonl" if result_dir is not None else None)
        return cls(output, result_dir, requests_path)

    def result_path(self, sc: Scenario | None, model: str | None) -> Path | None:
        """-o FILE as given, or under --result-dir a vLLM-style name from the run."""
        if self.result_dir is None:
            return self.output
        backend = backend_name(sc.endpoint) if sc is not None else "openai"
        rate = sc.request_rate if sc is not None else math.inf
        return unique_path(self.result_dir / result_filename(backend, rate, sc.max_concurrency if sc is not None else None,
                                                             model))

    def write_failed(self, exc: InfraAgentError, attempt: _Attempt) -> None:
        """No run: still leave a result saying why, where one was asked for."""
        path = self.result_path(attempt.scenario, attempt.model)
        if path is not None and attempt.scenario is not None:
            tail = exc.log_tail if isinstance(exc, ServerStartError) else ""
            log = exc.log_path if isinstance(exc, ServerStartError) else None
            write_result({**failed_result(str(exc).split("\n", 1)[0], tail, log), **attempt.extra}, path)

    def write(self, result: dict[str, Any], attempt: _Attempt) -> Path | None:
        """Write the result (renaming the per-request records to match it); the path written, if any."""
        path = self.result_path(attempt.scenario, result.get("model_id") or attempt.model)
        requests_path = self.requests_path
        if self.result_dir is not None and path is not None and requests_path is not None and requests_path.exists():
            final = requests_path_for(path)
            os.replace(requests_path, final)
            result["requests_file"] = str(final)
        if path is not None:
            write_result(result, path)
        return path


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        target: str = typer.Argument(..., help="An OpenAI-compatible base URL (http://host:port) or a workspace folder."),
        scenario: str | None = typer.Option(None, "--scenario", help="Workspace scenario name."),
        set_: list[str] = typer.Option([], "--set", help="Knob override knob=value (workspace mode); repeatable."),
        num_requests: int | None = typer.Option(None, "--num-requests"),
        max_concurrency: int | None = typer.Option(None, "--max-concurrency"),
        request_rate: float | None = typer.Option(None, "--request-rate", help="Requests/s; inf sends all at once."),
        burstiness: float | None = typer.Option(None, "--burstiness", help="Gamma shape of the gaps; 1 is Poisson."),
        dataset: str | None = typer.Option(None, "--dataset", help="URL mode: random (default) | jsonl | shared_prefix."),
        input_len: int | None = typer.Option(None, "--input-len", help="URL mode (default 128)."),
        output_len: int | None = typer.Option(None, "--output-len", help="URL mode (default 64)."),
        range_ratio: float | None = typer.Option(None, "--range-ratio", help="URL mode (default 0)."),
        dataset_path: Path | None = typer.Option(None, "--dataset-path", help="JSONL prompt file (--dataset jsonl)."),
        prefix_len: int | None = typer.Option(None, "--prefix-len", help="URL mode (default 256)."),
        num_prefixes: int | None = typer.Option(None, "--num-prefixes", help="URL mode (default 1)."),
        seed: int | None = typer.Option(None, "--seed", help="URL mode (default 0)."),
        endpoint: str | None = typer.Option(None, "--endpoint", help="completions (URL-mode default) | chat"),
        model: str | None = typer.Option(None, "--model", help="Model name to send (default: first of /v1/models)."),
        metrics_url: str | None = typer.Option(None, "--metrics-url", help="URL mode: Prometheus /metrics to diff."),
        warmup: int | None = typer.Option(None, "--warmup-requests",
                                          help="Full-length requests before the window (URL-mode default 0: only a 2-token check)."),
        temperature: float | None = typer.Option(None, "--temperature", help="Sampling temperature sent (URL-mode default 0)."),
        slo_ttft_ms: float | None = typer.Option(None, "--slo-ttft-ms"),
        slo_tpot_ms: float | None = typer.Option(None, "--slo-tpot-ms"),
        slo_e2el_ms: float | None = typer.Option(None, "--slo-e2el-ms"),
        percentiles: str = typer.Option("99", "--percentiles", help="Comma-separated, e.g. 50,90,95,99."),
        output: Path | None = typer.Option(None, "--output", "-o", help="Write the result JSON here (and FILE.requests.jsonl)."),
        result_dir: Path | None = typer.Option(None, "--result-dir",
                                               help="Write the result here, named {backend}-{rate}qps-{model}-{timestamp}.json."),
        max_failed_fraction: float = typer.Option(0.0, "--max-failed-fraction",
                                                  help="Fail the run (exit 1) when more of its requests fail than this (0 to 1)."),
        api_key_env: str | None = typer.Option(None, "--api-key-env",
                                               help="URL mode: NAME of the environment variable holding the API key (sent as a bearer token)."),
        header: list[str] = typer.Option([], "--header", help="URL mode: an extra request header 'Name: value'; repeatable."),
        tokenizer: str | None = typer.Option(None, "--tokenizer",
                                             help="What counts prompt lengths: byte (default) or hf:PATH, the served model's "
                                                  "tokenizer folder (workspace mode: overrides the scenario's)."),
        latency_def: str = typer.Option("vllm", "--latency-def",
                                        help="vllm (default): every streamed chunk with choices is a token, as vllm bench serve "
                                             "counts; content: only chunks with text. The other is reported beside."),
        no_progress: bool = typer.Option(False, "--no-progress"),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """Run one serving benchmark and print vLLM-style metrics (+ server phases)."""
        with user_errors(as_json):
            check_target_text(target)
            options = _runner_options(percentiles, latency_def, tokenizer, max_failed_fraction, not no_progress)
            destination = ResultDestination.from_flags(output, result_dir)
            load = {k: v for k, v in (("num_requests", num_requests), ("max_concurrency", max_concurrency),
                                       ("request_rate", request_rate), ("burstiness", burstiness),
                                       ("endpoint", endpoint), ("warmup_requests", warmup),
                                       ("temperature", temperature)) if v is not None}
            slo = {k: v for k, v in (("ttft_ms", slo_ttft_ms), ("tpot_ms", slo_tpot_ms), ("e2el_ms", slo_e2el_ms)) if v is not None}
            flags = UrlFlags(dataset, input_len, output_len, range_ratio, dataset_path, prefix_len, num_prefixes, seed,
                             model, metrics_url, api_key_env, header)
            attempt = _Attempt(model=model)
            try:
                if _URL.match(target):
                    result = _run_url(target, flags, load, slo, attempt, options, destination.requests_path)
                else:
                    result = _run_workspace(target, scenario, set_, flags, load, slo, attempt, options,
                                            destination.requests_path)
            except InfraAgentError as exc:
                destination.write_failed(exc, attempt)
                raise
            result = {**attempt.extra, **result}
            path = destination.write(result, attempt)
            emit(result, as_json, lambda console: render_result(result, console, path))
            if not result.get("ok", True):
                raise typer.Exit(code=1)
