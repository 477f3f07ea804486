"""`infra-agent --help` imports no heavy module; each verb module's top level stays light.

The rules are in ``infra_agent.cli.main``'s docstring.  Each check runs in a fresh
interpreter, since this test process has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infra_agent.cli.main import _VERB_MODULES, load_verb

HEAVY = ("scipy", "numpy", "torch", "aiohttp", "pandas", "optuna", "openai", "fastapi", "uvicorn")
# What `infra-agent VERB --help` may not import either (a verb module's top level).
HEAVY_FOR_A_VERB = (*HEAVY, "httpx")  # pydantic: typer itself imports it to build a command
# Verb modules outside this change's reach that still import heavy modules at top level.
KNOWN_HEAVY_VERBS: dict[str, str] = {}  # verb -> why its own --help is still heavy (none today)

_PROBE = """
import json, sys
sys.argv = ["infra-agent", *json.loads(sys.argv[1])]
from infra_agent.cli.main import app
try:
    app()
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(json.dumps({"code": code, "modules": sorted({m.split(".")[0] for m in sys.modules})}), file=sys.stderr)
"""


def _run(*args: str) -> tuple[int, set[str], str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(args))], capture_output=True, text=True, timeout=120,
                          check=False)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    return report["code"], set(report["modules"]), proc.stdout


def test_help_imports_no_heavy_module() -> None:
    code, modules, out = _run("--help")
    assert code == 0
    for verb in _VERB_MODULES:
        assert verb in out  # every verb is listed ...
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    # ... without importing any verb module
    code, _, _ = _run("--version")
    assert code == 0


def test_no_arguments_shows_help_cheaply() -> None:
    code, modules, _ = _run()
    assert code in (0, 2)  # click's no_args_is_help exit status differs between versions
    assert not modules & set(HEAVY)


@pytest.mark.parametrize("verb", list(_VERB_MODULES))
def test_verb_help_keeps_its_module_light(verb: str) -> None:
    if verb in KNOWN_HEAVY_VERBS:
        pytest.xfail(KNOWN_HEAVY_VERBS[verb])
    code, modules, out = _run(verb, "--help")
    assert code == 0 and "Usage" in out
    assert not modules & set(HEAVY_FOR_A_VERB), sorted(modules & set(HEAVY_FOR_A_VERB))


@pytest.mark.parametrize("verb", list(_VERB_MODULES))
def test_listed_help_is_the_commands_own(verb: str) -> None:
    # `--help` lists the one-liners of _VERB_MODULES; they must not drift from the commands'.
    command = load_verb(verb)
    own = (command.help or "").strip().split("\n\n")[0].replace("\n", " ")
    assert _VERB_MODULES[verb] == own


def test_a_misspelled_verb_is_suggested_without_loading_anything() -> None:
    proc = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "comprae"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert "compare" in proc.stderr
