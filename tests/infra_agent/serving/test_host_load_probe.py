"""The serving probe records the machine's load per window, against the real refstack server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra_agent.probes.base import ProbeContext
from infra_agent.probes.serving import ServingProbe

pytestmark = pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux /proc")

_SCENARIO = {"dataset": {"kind": "random", "input_len": 16, "output_len": 8, "seed": 3}, "temperature": 1.0,
             "num_requests": 8, "max_concurrency": 4}


def test_each_window_records_the_machines_load(refstack_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fb = ServingProbe().run({"url": refstack_server.url, "metrics_url": refstack_server.url + "/metrics",
                             "scenario": _SCENARIO, "repeats": 2}, ProbeContext(workdir=tmp_path, progress=False))
    assert fb.ok, fb.error
    host = fb.meta["host"]
    assert {"loadavg_start", "loadavg_end", "foreign_cpu", "cores", "source", "seconds", "windows"} <= set(host)
    assert host["source"] == "proc" and host["cores"] >= 1
    windows = host["windows"]
    assert [(w["scenario"], w["index"]) for w in windows] == [("inline", 0), ("inline", 1)]
    assert host["foreign_cpu"] == max(w["foreign_cpu"] for w in windows)
    # The loopback server is found by its listening socket: its work is the experiment's, not foreign.
    assert all(w["own_cpu"] > 0 for w in windows)
    for name, unit, key in (("host_foreign_cpu", "cores", "foreign_cpu"), ("host_load_1m", "load", "loadavg_end")):
        m = fb.measurement(name, scenario="inline")
        assert m.unit == unit and m.better == "lower" and m.tags["component"] == "runtime"
        assert m.samples == [w[key] for w in windows]
    result = json.loads((tmp_path / "serving-inline-0.json").read_text())
    assert result["host"] == {k: v for k, v in windows[0].items() if k not in ("scenario", "index")}
