"""This example's knob domains and defaults as the installed vLLM build gives them.

    python examples/vllm-serving/knobs_from_help.py            # asks the vLLM installed here
    python examples/vllm-serving/knobs_from_help.py help.txt   # or reads a saved help text
    python examples/vllm-serving/knobs_from_help.py --write    # and sets the defaults in infra-agent.yaml

Choices and on/off pairs come from ``vllm serve --help=all``, run through the module
entrypoint where the ``vllm`` script cannot run (the CPU build: infra_agent.target.vllm_build).
``max_num_seqs`` and ``max_num_batched_tokens`` print as ``None`` there: vLLM fills them in
by platform when the server starts (128 and 2048 on a CPU server; 256 or 1024, and 2048
to 8192, on GPUs by memory), so those defaults are asked of the build itself
(``EngineArgs.get_batch_defaults``).  Integer ranges are not in the help: they are the
ones infra-agent.yaml keeps.  ``--write`` puts the build's defaults into the workspace
file (the baseline of a run), leaving its comments and everything else as they are.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from infra_agent.serving.serve_help import knob_spec, parse_help
from infra_agent.target import vllm_build

# option name -> (type when the help gives no choices, the range kept by hand)
KNOBS = {
    "max_num_seqs": ("int", {"min": 1, "max": 4096}),
    "max_num_batched_tokens": ("int", {"min": 16, "max": 1048576}),
    "enable_chunked_prefill": ("choice", {}),
    "enable_prefix_caching": ("choice", {}),
    "kv_cache_dtype": ("choice", {}),
}
WORKSPACE = Path(__file__).with_name("infra-agent.yaml")


def installed_help() -> tuple[str, str]:
    """``vllm serve --help=all`` of the build installed, and the command that printed it."""
    argv, env = vllm_build.help_command(dict(os.environ))
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0 or "--max-num-seqs" not in done.stdout:
        sys.exit(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout, " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv))


def knobs(text: str, source: str, defaults: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    options = parse_help(text)
    out = {name: knob_spec(options, name, kind, source=source, **domain) for name, (kind, domain) in KNOBS.items()}
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if defaults and defaults.get(name) is not None:
            out[name]["default"] = int(defaults[name])
    return out


def write_defaults(path: Path, values: dict[str, Any], note: str) -> list[str]:
    """Set ``knobs.NAME.default`` in the workspace file for each of ``values``; comments stay."""
    lines = path.read_text().splitlines(keepends=True)
    changed = []
    for name, value in values.items():
        start = next((i for i, line in enumerate(lines) if re.match(rf"^  {name}:\s*$", line)), None)
        if start is None:
            raise SystemExit(f"{path}: no knob {name!r} under knobs:")
        for i in range(start + 1, len(lines)):
            if not lines[i].startswith("    "):
                raise SystemExit(f"{path}: knob {name!r} has no 'default:' line")
            if re.match(r"^    default:", lines[i]):
                lines[i] = f"    default: {value}  # {note}\n"
                changed.append(f"{name}={value}")
                break
    path.write_text("".join(lines))
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("help_file", nargs="?", type=Path, help="a saved `vllm serve --help=all` (else: run it)")
    ap.add_argument("--write", nargs="?", const=WORKSPACE, type=Path, metavar="WORKSPACE_YAML",
                    help="set the build's defaults in this workspace file (default: the example's)")
    a = ap.parse_args()
    if a.help_file:
        text, source, defaults = a.help_file.read_text(), str(a.help_file), None
    else:
        text, source = installed_help()
        defaults = vllm_build.batch_defaults(dict(os.environ))
    spec = knobs(text, source, defaults)
    print(yaml.safe_dump({"knobs": spec}, sort_keys=False, width=100))
    if a.write:
        if defaults is None:
            sys.exit("--write needs the installed build (its defaults are not in a saved help text)")
        note = f"vLLM {defaults.get('version')}'s own default on this machine"
        values = {n: spec[n]["default"] for n in ("max_num_seqs", "max_num_batched_tokens")}
        print(f"# {a.write}: {', '.join(write_defaults(a.write, values, note))}", file=sys.stderr)


if __name__ == "__main__":
    main()
