"""``TimelineConfig``: what the timeline probe runs, how it traces it, and what it expects.

Apart from the probe because the probe's parts (the sampled window in
``timeline_sampling.py``, the analysis in ``timeline_analysis.py``) all read it, and a
config is data, not the run that uses it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from infra_agent.probes.base import ProbeConfig
from infra_agent.workspace.models import Scenario

# Span category (or name prefix) -> the component a finding about it is located in.
DEFAULT_SPAN_COMPONENTS: dict[str, str] = {
    "ep": "comm", "comm": "comm", "nccl": "comm", "kv": "kv_transfer", "transfer": "kv_transfer",
    "engine": "engine", "http": "server", "model": "model", "gc": "runtime.gc",
}


class TimelineConfig(ProbeConfig):
    """What to run, how to trace it, and what to expect; every key is optional."""

    scenarios: list[str] | None = Field(None, description="workspace scenarios; the first one is traced (default: the first declared)")
    scenario: Scenario | None = Field(None, description="an inline scenario, run as 'inline'")
    knobs: dict[str, Any] = Field(default_factory=dict, description="knob overrides on top of the context's knobs")
    greedy_tokens: int = Field(12, ge=0, le=256,
                               description="greedy tokens per prompt of the fixed probe set asked once per server before "
                                           "a traced window (the judge holds a change to its parent's text); 0: not asked")
    trace_knobs: dict[str, Any] = Field(default_factory=lambda: {"trace": True, "trace_level": "layer"},
                                        description="knobs that turn tracing on when this probe launches the target "
                                                    "(only those the workspace declares are applied); trace_level "
                                                    "layer: the per-layer spans its EP and GIL findings need")
    trace_path: str = Field("/debug/trace", description="GET path of the server's Chrome trace")
    reset: bool = Field(True, description="clear the server's span buffer (?reset=true) before the window")
    sample: bool = Field(True, description="sample GIL holders with py-spy dump during the window")
    profile: bool = Field(False, description="also run the target's torch.profiler over the traced window (POST "
                                             "/start_profile, /stop_profile: refstack, vLLM, SGLang); its Kineto trace "
                                             "joins the timeline, with a GPU's streams and the launch_bound finding")
    sample_process: str = Field(
        "auto", min_length=1,
        description="auto: the busiest of the server and its child processes over the first lead_s; server: the "
                    "server; any other value: the child process of that name (/proc/PID/comm, e.g. prefill-worker)")
    lead_s: float = Field(0.5, ge=0, le=30, description="load time before the process is picked and sampling starts")
    sample_interval_s: float = Field(0.0, ge=0, le=5)
    loop_stalls: bool = Field(True, description="also py-spy record the sampled process (every thread, idle ones too) "
                                                "for its event loops' stalls: time away from the selector")
    stall_rate_hz: int = Field(200, ge=10, le=1000, description="py-spy record's rate for loop stalls: their resolution")
    expect_overlap: list[str] = Field(default_factory=list,
                                      description="'A:B' span groups (names or categories, '|' joins) that should overlap")
    knob_hints: dict[str, str] = Field(default_factory=dict,
                                       description="pattern -> knob: a finding whose holder file, function or span holds "
                                                   "the pattern names the knob")
    span_components: dict[str, str] = Field(default_factory=dict,
                                            description="span category -> component, over the defaults (ep -> comm ...)")
    by: Literal["cat", "name"] = "cat"
    repeats: int = Field(1, ge=1, le=20, description="sampled windows (the first is traced and analysed)")
    compare_knob: str | None = Field(None, description="run two servers differing only in this knob, interleaved")
    compare_values: list[Any] | None = Field(None, description="[reference, tested]; default [false, true] for a bool knob")
    compare_pairs: int = Field(3, ge=1, le=50)
    compare_metric: str = Field("input_throughput", description="result key (or input_throughput) the ratio is of")
    ratio_name: str | None = Field(None, description="measurement name of the ratio (default <knob>_ratio)")
    min_ratio: float | None = Field(None, gt=0, description="a gate on the ratio: ok=False when its 95% interval lies wholly below this")
    # The serving probe's keys, so the executor's A/B job can pass them on.
    result_metrics: list[str] | None = None
    percentiles: list[float] = Field(default_factory=lambda: [50.0, 90.0, 99.0])
    queue_share: float = Field(0.5, gt=0, le=1)
