"""Random and malformed input to ``compare`` and ``validate``: clear errors, never a traceback.

Seeded and bounded: every input is an ordinary user mistake or garbage (random bytes,
truncated JSON, wrong types, mutated workspace YAML).  Each must end with status 0, 1
or 2 and a message, with no exception escaping the command.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from infra_agent.cli.main import app

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "refstack-serving" / "infra-agent.yaml"
GOOD_RUN = {"ok": True, "completed": 10, "failed": 0, "num_prompts": 10, "output_throughput": 100.0,
            "median_ttft_ms": 12.0, "ttfts": [0.012] * 10, "model_id": "m", "endpoint": "completions",
            "max_concurrency": 4, "request_rate": "inf", "dataset": {"kind": "random", "input_len": 8}}


def _garbage(rng: random.Random) -> Any:
    choices = [None, True, -1, 0, 1e308, float("nan"), "", "x" * 50, [], {}, [1, "a"], {"a": {"b": []}}]
    return rng.choice(choices)


def _mutate(obj: Any, rng: random.Random, depth: int = 0) -> Any:
    if isinstance(obj, dict) and obj:
        out = dict(obj)
        key = rng.choice(sorted(out, key=str))
        action = rng.random()
        if action < 0.3:
            del out[key]
        elif action < 0.6 or depth > 3:
            out[key] = _garbage(rng)
        else:
            out[key] = _mutate(out[key], rng, depth + 1)
        if rng.random() < 0.15:
            out[rng.choice(["colour", "unknown_key", "knobz"])] = _garbage(rng)
        return out
    if isinstance(obj, list) and obj:
        out_l = list(obj)
        i = rng.randrange(len(out_l))
        out_l[i] = _mutate(out_l[i], rng, depth + 1) if rng.random() < 0.5 else _garbage(rng)
        return out_l
    return _garbage(rng)


def _run(args: list[str]) -> tuple[int, str, BaseException | None]:
    res = CliRunner().invoke(app, args, catch_exceptions=True)
    exc = res.exception if not isinstance(res.exception, SystemExit) else None
    return res.exit_code, res.output, exc


def test_compare_survives_random_input(tmp_path: Path) -> None:
    rng = random.Random(1234)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"runs": [GOOD_RUN] * 3}))
    tried = failures = 0
    for i in range(80):
        bad = tmp_path / f"bad{i}.json"
        kind = i % 4
        if kind == 0:
            bad.write_bytes(rng.randbytes(rng.randrange(0, 400)))
        elif kind == 1:
            text = json.dumps({"runs": [GOOD_RUN] * 3})
            bad.write_text(text[: rng.randrange(1, len(text))])
        elif kind == 2:
            bad.write_text(json.dumps(_mutate({"runs": [GOOD_RUN] * 3}, rng), default=str))
        else:
            bad.write_text(json.dumps(_mutate(GOOD_RUN, rng), default=str))
        for args in (["compare", str(good), str(bad)], ["compare", str(bad), str(good), "--json"]):
            tried += 1
            code, out, exc = _run(args)
            ok = exc is None and code in (0, 1, 2) and "Traceback" not in out
            failures += not ok
            assert ok, (args, code, out[-2000:], exc)
    assert tried == 160 and failures == 0


def test_validate_survives_random_input(tmp_path: Path) -> None:
    rng = random.Random(4321)
    spec = yaml.safe_load(EXAMPLE.read_text())
    tried = 0
    for i in range(80):
        ws = tmp_path / f"ws{i}"
        ws.mkdir()
        f = ws / "infra-agent.yaml"
        kind = i % 3
        if kind == 0:
            f.write_bytes(rng.randbytes(rng.randrange(0, 300)))
        elif kind == 1:
            text = EXAMPLE.read_text()
            f.write_text(text[: rng.randrange(1, len(text))] + rng.choice(["", ":", "\n  - [", "\t{"]))
        else:
            f.write_text(yaml.safe_dump(_mutate(spec, rng), allow_unicode=True))
        tried += 1
        code, out, exc = _run(["validate", str(ws), "--json"] if i % 2 else ["validate", str(ws)])
        assert exc is None and code in (0, 2) and "Traceback" not in out, (f.read_bytes()[:500], code, out[-2000:], exc)
        if code == 2:
            # The message names the file.
            assert "infra-agent.yaml" in out
    assert tried == 80
