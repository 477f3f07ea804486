"""Print this example's knob domains as the installed vLLM's help gives them.

    python examples/vllm-serving/knobs_from_help.py            # runs `vllm serve --help=all`
    python examples/vllm-serving/knobs_from_help.py help.txt   # or reads a saved help text

Choices and on/off pairs come from the help; integer ranges are not in it, so they are
the ones infra-agent.yaml keeps.  Paste what changed into the `knobs:` section.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from infra_agent.serving.serve_help import knob_spec, parse_help

# option name -> (type when the help gives no choices, the range kept by hand)
KNOBS = {
    "max_num_seqs": ("int", {"min": 1, "max": 4096}),
    "max_num_batched_tokens": ("int", {"min": 16, "max": 1048576}),
    "enable_chunked_prefill": ("choice", {}),
    "enable_prefix_caching": ("choice", {}),
    "kv_cache_dtype": ("choice", {}),
}


def main() -> None:
    if len(sys.argv) > 1:
        text, source = Path(sys.argv[1]).read_text(), sys.argv[1]
    else:
        text = subprocess.run(["vllm", "serve", "--help=all"], capture_output=True, text=True, check=True).stdout
        source = "vllm serve --help=all"
    options = parse_help(text)
    knobs = {name: knob_spec(options, name, kind, source=source, **domain) for name, (kind, domain) in KNOBS.items()}
    print(yaml.safe_dump({"knobs": knobs}, sort_keys=False, width=100))


if __name__ == "__main__":
    main()
