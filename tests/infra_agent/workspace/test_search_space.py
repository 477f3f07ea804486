"""The search space a workspace declares: scale, typical ranges, resource bounds, the machine,
constraints and aliases.  Bad input is a ConfigError naming file, field, expected and got."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra_agent.errors import ConfigError
from infra_agent.workspace import load_workspace
from infra_agent.workspace.constraints import ConstraintSyntaxError, parse_constraint
from infra_agent.workspace.machine import knob_bound, oversubscriptions

REPO = Path(__file__).resolve().parents[3]

SPACE = """\
  threads: {type: int, min: 0, max: 1024, default: 1, resource: threads, per_process: 2, components: [runtime]}
  seqs: {type: int, min: 1, max: 4096, default: 256, typical: [16, 1024], components: [engine.scheduler]}
  budget: {type: int, min: 16, max: 1048576, default: 8192, scale: log, components: [engine.scheduler]}
  frac: {type: float, min: 0.1, max: 0.95, default: 0.85, components: [engine.cache]}
  kv: {type: choice, choices: [auto, bfloat16, fp8], default: auto, aliases: {auto: bfloat16}, components: [engine.cache]}
constraints: ["budget >= seqs", "seqs * 2 <= budget + 1"]
"""


def _space(good: str, extra: str = SPACE) -> str:
    """GOOD with the search-space knobs added to its knob section (and its constraints)."""
    head, sep, tail = good.partition("scenarios:\n")
    return head + extra + sep + tail


def test_the_search_space_loads(write_ws, good: str) -> None:
    ws = load_workspace(write_ws(_space(good)))
    threads, seqs, budget, frac, kv = (ws.knobs[k] for k in ("threads", "seqs", "budget", "frac", "kv"))
    assert seqs.typical == [16, 1024] and seqs.log_scale  # 4096/1 >= 64 from a positive min: log by default
    assert budget.log_scale and not frac.log_scale and not threads.log_scale  # min 0: linear
    assert (threads.resource, threads.processes, seqs.processes) == ("threads", 2, 1)
    assert kv.aliases == {"auto": "bfloat16"} and kv.canonical("auto") == "bfloat16" and kv.canonical("fp8") == "fp8"
    assert [c.text for c in ws.parsed_constraints] == ["budget >= seqs", "seqs * 2 <= budget + 1"]
    assert ws.broken_constraints({"budget": 20, "seqs": 256})[0][0] == 0
    assert ws.broken_constraints({"budget": 8192, "seqs": 256}) == []


def test_the_machine_is_this_one_unless_the_workspace_says(write_ws, good: str) -> None:
    ws = load_workspace(write_ws(_space(good)))
    limits = ws.machine_limits()
    assert limits.cores == len(os.sched_getaffinity(0)) and "sched_getaffinity" in limits.cores_from
    assert limits.memory_gib is not None and limits.memory_gib > 0 and "MemTotal" in limits.memory_from
    bound = knob_bound("threads", ws.knobs["threads"], limits)
    assert bound is not None and bound.limit == limits.cores // 2  # two processes take the value each
    ws = load_workspace(write_ws(_space(good, SPACE + "machine: {cores: 8, memory_gib: 64}\n")))
    limits = ws.machine_limits()
    assert (limits.cores, limits.memory_gib) == (8, 64.0) and limits.cores_from == "machine.cores in infra-agent.yaml"
    bound = knob_bound("threads", ws.knobs["threads"], limits)
    assert bound is not None and bound.limit == 4


def test_oversubscription_counts_every_process() -> None:
    ws = load_workspace(REPO / "examples" / "kv-transfer")
    limits = ws.machine_limits()
    over = oversubscriptions(ws.knobs, {**ws.resolve_knobs(), "torch_threads": 448}, limits)
    assert len(over) == 1
    assert over[0].message().startswith(f"oversubscribes the machine: torch_threads=448 x 2 processes > {limits.cores} cores (")
    assert oversubscriptions(ws.knobs, ws.resolve_knobs(), limits) == [] or limits.cores < 2
    # a step that leaves the thread knobs alone is not the one to blame
    assert oversubscriptions(ws.knobs, {**ws.resolve_knobs(), "torch_threads": 448}, limits, only={"max_batch_tokens"}) == []


@pytest.mark.parametrize(("text", "ok"), [
    ("a >= b", True), ("a*2 <= b + 1", True), ("a != 3", True), ("2 < a / 4", True), ("a >= -1", True),
    ("a", False), ("a >= b >= c", False), ("__import__('os') == 1", False), ("a ** 2 >= b", False),
    ("a >= b * c", False), ("a / 0 > 1", False), ("a >= ", False),
])
def test_the_constraint_grammar_is_tiny_and_never_evaluated(text: str, ok: bool) -> None:
    if ok:
        c = parse_constraint(text)
        assert c.holds({"a": 1000, "b": 1}) or c.holds({"a": 1, "b": 1000}) or text == "a != 3"
    else:
        with pytest.raises(ConstraintSyntaxError):
            parse_constraint(text)


def test_a_broken_constraint_says_how() -> None:
    c = parse_constraint("max_num_batched_tokens >= max_num_seqs")
    values = {"max_num_batched_tokens": 20, "max_num_seqs": 256}
    assert not c.holds(values) and c.broken(values) == "max_num_batched_tokens=20 < max_num_seqs=256"
    assert parse_constraint("a * 2 <= b").broken({"a": 3, "b": 5}) == "a=3 * 2 > b=5"
    assert c.holds({"max_num_seqs": 256})  # a knob without a value cannot break it


# (description, edit of the search-space text, field path, fragment of expected, got)
BAD = [
    ("unknown knob in a constraint", lambda t: t.replace('"seqs * 2', '"sqs * 2'), "constraints.1",
     "knob names among the declared int and float knobs (budget, delay, frac, max_running, seqs, threads)", "sqs"),
    ("a constraint on a choice knob", lambda t: t.replace('"budget >= seqs"', '"kv >= 1"'), "constraints.0",
     "knob names among the declared int and float knobs", "kv"),
    ("defaults violate a constraint", lambda t: t.replace('"budget >= seqs"', '"seqs >= budget"'), "constraints.0",
     "knob defaults that satisfy 'seqs >= budget'", "seqs=256 < budget=8192"),
    ("constraint syntax", lambda t: t.replace('"budget >= seqs"', '"budget >= seqs >= 1"'), "constraints.0",
     "a constraint such as 'a >= b'", "budget >= seqs >= 1"),
    ("typical outside [min, max]", lambda t: t.replace("typical: [16, 1024]", "typical: [16, 8192]"), "knobs.seqs.typical",
     "[lo, hi] with min <= lo <= hi <= max (int in [1, 4096])", [16, 8192]),
    ("typical upside down", lambda t: t.replace("typical: [16, 1024]", "typical: [1024, 16]"), "knobs.seqs.typical",
     "[lo, hi] with min <= lo <= hi <= max", [1024, 16]),
    ("typical of one value", lambda t: t.replace("typical: [16, 1024]", "typical: [16]"), "knobs.seqs.typical",
     "[lo, hi]", [16]),
    ("bad scale", lambda t: t.replace("scale: log", "scale: logarithmic"), "knobs.budget.scale", "'log' or 'linear'", "logarithmic"),
    ("log scale from zero", lambda t: t.replace("max: 1024, default: 1, resource", "max: 1024, default: 1, scale: log, resource"),
     "knobs.threads.scale", "a positive min for scale log", 0),
    ("scale on a choice knob", lambda t: t.replace("default: auto, aliases", "default: auto, scale: log, aliases"),
     "knobs.kv.scale", "scale only on int or float knobs", "choice"),
    ("bad resource", lambda t: t.replace("resource: threads", "resource: cores"), "knobs.threads.resource",
     "'threads', 'memory_gib' or 'memory_mib'", "cores"),
    ("per_process without a resource", lambda t: t.replace("typical: [16, 1024],", "typical: [16, 1024], per_process: 2,"),
     "knobs.seqs.per_process", "per_process only with resource", 2),
    ("per_process below 1", lambda t: t.replace("per_process: 2", "per_process: 0"), "knobs.threads.per_process",
     "a number greater than or equal to 1", 0),
    ("alias outside the domain", lambda t: t.replace("{auto: bfloat16}", "{auto: bf16}"), "knobs.kv.aliases.auto",
     "a value of the knob (one of 'auto', 'bfloat16', 'fp8')", "bf16"),
    ("machine with no cores", lambda t: t + "machine: {cores: 0}\n", "machine.cores", "a number greater than 0", 0),
    ("unknown machine key", lambda t: t + "machine: {gpus: 8}\n", "machine.gpus", "one of the keys cores, memory_gib", "gpus"),
]


@pytest.mark.parametrize(("edit", "field", "expected", "got"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_search_space_names_file_field_expected_got(write_ws, good: str, edit, field, expected, got) -> None:
    text = edit(SPACE)
    assert text != SPACE, "the edit must change the file"
    file = write_ws(_space(good, text))
    with pytest.raises(ConfigError) as info:
        load_workspace(file.parent)
    err = info.value
    assert err.field == field, str(err)
    assert expected in err.expected, str(err)
    assert err.got == got, str(err)
    message = str(err)
    assert str(file) in message and field in message and "pydantic" not in message
    assert err.file is not None and err.file.startswith(str(file) + ":")  # file:line:col


def test_the_examples_declare_their_spaces() -> None:
    vllm = load_workspace(REPO / "examples" / "vllm-serving")
    assert [c.text for c in vllm.parsed_constraints] == ["max_num_batched_tokens >= max_num_seqs"]
    assert vllm.knobs["max_num_seqs"].typical and vllm.knobs["max_num_batched_tokens"].typical
    assert vllm.knobs["kv_cache_dtype"].canonical("auto") == vllm.knobs["kv_cache_dtype"].canonical("bfloat16")
    kv = load_workspace(REPO / "examples" / "kv-transfer").knobs["torch_threads"]
    assert (kv.resource, kv.processes) == ("threads", 2)
    serving = load_workspace(REPO / "examples" / "refstack-serving").knobs
    assert serving["torch_threads"].resource == "threads" and serving["max_running"].typical == [4, 256]
    sglang = load_workspace(REPO / "examples" / "sglang-serving").knobs
    assert sglang["max_running_requests"].typical and sglang["kv_cache_dtype"].aliases == {"auto": "bfloat16"}
