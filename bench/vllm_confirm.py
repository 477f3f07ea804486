"""Configurations of the vLLM example against its defaults, measured by vLLM's own client.

    python bench/vllm_confirm.py [--rounds 6] [--config NAME:knob=value,knob=value ...]

The workspace is ``bench/tune_vllm.py``'s (the tiny random Llama, the build's defaults, read
as ``tune_vllm.py`` reads them: 128 sequences and 2048 batched tokens on the CPU build).  Every configuration gets a fresh server; then each
round runs ``vllm bench serve`` once against each, in rotated order (forward, backward, ...),
and each configuration's output throughput is compared with the defaults' as the geometric
mean of its per-round ratios with a 95% t-interval.  By default the two configurations that
``tune_vllm.py --start defaults --grid run`` singled out on 2026-12-07: the loop's best
(``max_num_batched_tokens`` 8269, bf16 KV cache) and the grid's top point (16 / 512).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_vllm import make_model, make_workspace, rotated_rounds, vllm_env  # noqa: E402

DEFAULT_CONFIGS = ["loop_best:max_num_batched_tokens=8269,kv_cache_dtype=bfloat16",
                   "grid_top:max_num_seqs=16,max_num_batched_tokens=512"]


def _config(text: str) -> tuple[str, dict[str, object]]:
    name, _, body = text.partition(":")
    knobs: dict[str, object] = {}
    for item in filter(None, body.split(",")):
        k, _, v = item.partition("=")
        try:
            knobs[k] = int(v)
        except ValueError:
            try:
                knobs[k] = float(v)
            except ValueError:
                knobs[k] = v
    if not name or name == "defaults":
        raise SystemExit(f"--config {text!r}: give it a name other than 'defaults' (the side it is compared with)")
    return name, knobs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="at least 2: the interval needs a spread")
    ap.add_argument("--config", action="append", default=None, help="NAME:knob=value,... (repeatable)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2")
    os.environ.update(vllm_env())
    from infra_agent.target import vllm_build

    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC; loadavg {Path('/proc/loadavg').read_text().strip()}",
          flush=True)
    sides = {"defaults": {}, **dict(_config(c) for c in (args.config or DEFAULT_CONFIGS))}
    with tempfile.TemporaryDirectory(prefix="vllm-confirm-") as tmp:
        work = Path(tmp)
        model = make_model(work / "tiny-llama")
        # The build's own defaults, as tune_vllm.py reads them (128 and 2048 on the CPU build).
        defaults = vllm_build.batch_defaults(dict(os.environ))
        ws = make_workspace(work / "ws", model, max_num_seqs=int(defaults["max_num_seqs"]),
                            max_num_batched_tokens=int(defaults["max_num_batched_tokens"]))
        got = rotated_rounds(ws, sides, model, args.rounds, work, "output_throughput", seed=100, say=True)
    names = list(sides)
    for n in names[1:]:
        logs = [math.log(b / a) for a, b in zip(got["defaults"], got[n], strict=True)]
        m, sd, k = statistics.mean(logs), statistics.stdev(logs), len(logs)
        half = stats.t.ppf(0.975, k - 1) * sd / math.sqrt(k)
        print(f"{n} / defaults, output throughput: {math.exp(m):.3f} [{math.exp(m - half):.3f}, "
              f"{math.exp(m + half):.3f}] (95% t-interval over {k} rounds)")
    print(f"end {time.strftime('%H:%M:%S', time.gmtime())} UTC; loadavg {Path('/proc/loadavg').read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
