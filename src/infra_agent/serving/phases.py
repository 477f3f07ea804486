"""Which Prometheus histogram measures which request phase, per serving stack.

One vocabulary of phases for every stack, so a finding ("queueing is 80% of TTFT")
reads the same on refstack, vLLM and SGLang:

| phase | meaning |
|---|---|
| queue | arrival -> first scheduled |
| prefill | first scheduled -> first token |
| decode | first token -> finished |
| inference | first scheduled -> finished (prefill + decode) |
| ttft | arrival -> first token, as the server sees it |
| tpot | per request: decode time / (output tokens - 1) |
| itl | per token: the gap before each output token |
| e2e | arrival -> finished |
| encode_queue | image requests: arrival -> the vision encoder starts on them |
| encode | image requests: time in the vision encoder |
| encode_transfer | image requests: embeddings to the prefill engine |

Names come from the stacks' own sources:

- vLLM (v1 engine, ``vllm/v1/metrics/loggers.py``): ``vllm:request_queue_time_seconds``,
  ``..._prefill_...``, ``..._decode_...``, ``..._inference_time_seconds``,
  ``vllm:time_to_first_token_seconds``, ``vllm:request_time_per_output_token_seconds``
  (per request), ``vllm:inter_token_latency_seconds`` (per token; older releases called
  it ``vllm:time_per_output_token_seconds``, which is why that name means ITL here and
  not TPOT), ``vllm:e2e_request_latency_seconds``.
- SGLang (``sglang/srt/metrics/collector.py``): ``sglang:queue_time_seconds``, the
  ``prefill_forward`` stage of ``sglang:per_stage_req_latency_seconds``,
  ``sglang:time_to_first_token_seconds``, ``sglang:inter_token_latency_seconds``,
  ``sglang:e2e_request_latency_seconds``.  It has no per-request decode, inference or
  TPOT histogram, so those phases are not expected from it.
- refstack (``refstack/server/metrics.py``): vLLM's names under ``refstack:``, with
  ``refstack:time_per_output_token_seconds`` one sample per request (TPOT).
"""

from __future__ import annotations

from collections.abc import Mapping

PHASE_ORDER = ("queue", "prefill", "decode", "inference", "ttft", "tpot", "itl", "e2e",
               "encode_queue", "encode", "encode_transfer")

# Labels whose value picks one series of a shared histogram (``name{label="v"}``).
SELECTOR_LABELS = ("stage",)

# stack -> phase -> histogram names, most recent first.
STACKS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "queue": ("vllm:request_queue_time_seconds",),
        "prefill": ("vllm:request_prefill_time_seconds",),
        "decode": ("vllm:request_decode_time_seconds",),
        "inference": ("vllm:request_inference_time_seconds",),
        "ttft": ("vllm:time_to_first_token_seconds",),
        "tpot": ("vllm:request_time_per_output_token_seconds",),
        "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "e2e": ("vllm:e2e_request_latency_seconds",),
    },
    "sglang": {
        "queue": ("sglang:queue_time_seconds",),
        "prefill": ('sglang:per_stage_req_latency_seconds{stage="prefill_forward"}',),
        "ttft": ("sglang:time_to_first_token_seconds",),
        "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        "e2e": ("sglang:e2e_request_latency_seconds",),
    },
    "refstack": {
        "queue": ("refstack:request_queue_time_seconds",),
        "prefill": ("refstack:request_prefill_time_seconds",),
        "decode": ("refstack:request_decode_time_seconds",),
        "ttft": ("refstack:time_to_first_token_seconds",),
        "tpot": ("refstack:time_per_output_token_seconds",),
        "e2e": ("refstack:e2e_request_latency_seconds",),
        "encode_queue": ("refstack:request_encode_queue_time_seconds",),
        "encode": ("refstack:request_encode_time_seconds",),
        "encode_transfer": ("refstack:request_encode_transfer_time_seconds",),
    },
}


def detect_stack(totals: Mapping[str, float]) -> str | None:
    """The stack whose prefix most histogram series in a scrape carry; None for none."""
    counts = {stack: sum(1 for k in totals if k.startswith(stack + ":")) for stack in STACKS}
    best = max(counts, key=lambda s: counts[s])
    return best if counts[best] else None
