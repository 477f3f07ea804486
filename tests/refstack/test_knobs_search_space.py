"""`refstack knobs --json` declares each numeric knob's search space (scale, typical range,
resource), and a workspace built from the listing carries it over."""

from __future__ import annotations

import json
import subprocess
import sys

from infra_agent.workspace.discover import workspace_knobs
from refstack.knobs import KNOBS


def test_the_listing_declares_the_search_space() -> None:
    r = subprocess.run([sys.executable, "-m", "refstack.cli", "knobs", "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    domains = {k["name"]: k["domain"] for k in json.loads(r.stdout)}
    assert domains["torch_threads"] == {"min": 0, "max": 1024, "scale": "linear", "resource": "threads", "per_process": 1}
    assert domains["max_running"]["scale"] == "log" and domains["max_running"]["typical"] == [4, 256]
    assert domains["max_batch_tokens"]["typical"] == [64, 8192]
    assert domains["step_delay_ms"]["scale"] == "linear" and "typical" not in domains["step_delay_ms"]
    assert domains["lm_head_precision"] == {"choices": ["fp32", "tf32", "3xtf32", "bf16"]}  # no scale on a choice
    for k in KNOBS:  # a typical range lies inside the domain
        if k.typical is not None:
            assert k.min is not None and k.max is not None and k.min <= k.typical[0] <= k.typical[1] <= k.max


def test_a_workspace_built_from_the_listing_carries_the_search_space() -> None:
    listing = [k.to_dict() for k in KNOBS]
    knobs, _ = workspace_knobs(listing, fixed={"preset": "tiny"})
    assert knobs["torch_threads"]["resource"] == "threads" and knobs["torch_threads"]["per_process"] == 1
    assert knobs["max_running"]["typical"] == [4, 256] and knobs["max_running"]["scale"] == "log"
    assert "scale" not in knobs["lm_head_precision"]


def test_the_table_shows_the_search_space() -> None:
    r = subprocess.run([sys.executable, "-m", "refstack.cli", "knobs"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "typical [4, 256]" in r.stdout and "threads x 1 process" in r.stdout
