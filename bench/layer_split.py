"""Layer Split: prefill throughput with request- vs layer-granular KV transfer over a modelled link.

    python bench/layer_split.py [--preset small] [--requests 8] [--prompt-len 400] [--pairs 6]
        [--link-ratio 1.0] [--kv-transfer false] [--set knob=value ...] [--json out.json]

Three disaggregated engines (``DisaggEngine``, in this process: the web stack would add
the same work to both sides) with the same knobs:

- ``free``: no modelled link (``kv_link_gbps 0``), request granularity: the prefill
  worker's compute alone, the bound the other two approach;
- ``request``: ``kv_transfer_granularity request`` over the link;
- ``layer``: ``kv_transfer_granularity layer`` over the same link.

The link is calibrated first so that moving a burst's KV takes ``--link-ratio`` times the
burst's prefill compute: the ``free`` engine's median burst time over 3 bursts (after a
warm-up) gives the compute time C, the model config gives the burst's KV bytes B (every
attention layer's K and V rows and every KDA state), and ``kv_link_gbps = B / (ratio * C)``.
Then the three run the same burst, ``--requests`` prompts of ``--prompt-len`` seeded
random token ids, ``max_tokens`` 2 (every request is handed off), interleaved pair by
pair (request layer, layer request, ...; ``free`` after each pair).  A burst's prefill
throughput is its prompt tokens over the time from sending it to the last first token.
Prints the medians, layer / request with a paired bootstrap 95% interval, and each side
against ``free``.  With ``--kv-transfer false`` (the default) the engine thread sends and
waits for the link before its next step (a connector whose forward ends when its saves
are out); ``true`` runs the kv-transfer thread instead, whose sends never block the step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from kv_transfer_prefill import engine_burst  # noqa: E402  (bench/ is not a package)

from infra_agent.stats.bootstrap import bootstrap_ratio  # noqa: E402


def kv_bytes(preset: str, length: int) -> int:
    """The bytes of one prompt's KV as the prefill side sends it: K and V rows of every
    attention layer, every KDA layer's state (fp32; page headers left out)."""
    from refstack.model import HybridConfig

    c = HybridConfig.preset(preset)
    attn = len(c.full_attention_layers) * 2 * c.num_kv_heads * length * c.head_dim * 4
    kda = len(c.kda_layers) * c.kda_num_heads * c.kda_head_k_dim * c.kda_head_v_dim * 4
    return attn + kda


def _engine(raw: dict[str, str]) -> Any:
    from refstack.disagg.frontend import DisaggEngine
    from refstack.knobs import engine_config, parse_knobs

    engine = DisaggEngine(engine_config(parse_knobs({**raw, "disagg": "true"})))
    engine.start()
    return engine


def _burst(engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    r = engine_burst(engine, prompts)
    if not r["ok"]:
        raise RuntimeError(f"a burst failed: {r['error']}")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=400)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--link-ratio", type=float, default=1.0, help="link time of a burst's KV over its prefill compute")
    ap.add_argument("--kv-transfer", default="false", choices=["true", "false"])
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="a knob for every engine")
    ap.add_argument("--json", dest="json_path")
    a = ap.parse_args(argv)
    raw = {"preset": a.preset, "torch_threads": "1", "kv_transfer": a.kv_transfer}
    raw.update(item.split("=", 1) for item in a.set)  # type: ignore[arg-type]
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(0, 256) for _ in range(a.prompt_len - 1)] for _ in range(a.requests)]
    nbytes = sum(kv_bytes(a.preset, len(p)) for p in prompts)
    tokens = sum(map(len, prompts))
    engines: dict[str, Any] = {}
    try:
        engines["free"] = _engine({**raw, "kv_link_gbps": "0", "kv_transfer_granularity": "request"})
        _burst(engines["free"], prompts)  # warm-up
        compute_s = statistics.median(_burst(engines["free"], prompts)["last_first_token_s"] for _ in range(3))
        gbps = nbytes / (a.link_ratio * compute_s) / 1e9
        print(f"burst: {a.requests} x {a.prompt_len} tokens, KV {nbytes / 1e6:.2f} MB; prefill compute "
              f"{compute_s * 1e3:.0f} ms -> kv_link_gbps {gbps:.4g} (link time {a.link_ratio:g} x compute)", flush=True)
        for side in ("request", "layer"):
            engines[side] = _engine({**raw, "kv_link_gbps": f"{gbps:.6g}", "kv_transfer_granularity": side})
            _burst(engines[side], prompts)  # warm-up
        out: dict[str, list[float]] = {"free": [], "request": [], "layer": []}
        for i in range(a.pairs):
            for side in (("layer", "request") if i % 2 else ("request", "layer")) + ("free",):
                r = _burst(engines[side], prompts)
                out[side].append(tokens / r["last_first_token_s"])
                print(f"  pair {i} {side:>7}: {out[side][-1]:.0f} prompt tok/s", flush=True)
    finally:
        for e in engines.values():
            e.stop()
    ci = bootstrap_ratio(out["layer"], out["request"], paired=True)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"\n| side | prefill tok/s (median of {a.pairs}) | vs free link |")
    print("|---|---|---|")
    for side in ("free", "request", "layer"):
        print(f"| {side} | {med[side]:.0f} | {med[side] / med['free']:.2f} |")
    verdict = "meets" if ci.low >= 1.3 else ("at" if ci.ratio >= 1.3 else "below")
    print(f"\nlayer / request = {ci.ratio:.3f}  (95% CI {ci.low:.3f}-{ci.high:.3f}, {a.pairs} pairs)  {verdict} the 1.3x goal")
    if a.json_path:
        with open(a.json_path, "w") as fh:
            json.dump({"args": vars(a), "kv_link_gbps": gbps, "compute_s": compute_s, "kv_bytes": nbytes, **out,
                       "ratio": ci.ratio, "low": ci.low, "high": ci.high}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
