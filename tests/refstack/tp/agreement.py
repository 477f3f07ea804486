"""Teacher-forced logprobs and greedy tokens from real servers, how two of them differ, and
where the served model's MoE routing is a near tie (``router_ties``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from infra_agent.probes.quality import load_prompts
from infra_agent.probes.quality_metrics import PromptLogprobs, parse_echo, top1
from refstack.engine.model_setup import unsampleable_ids
from refstack.model.batch import SeqChunk
from refstack.model.config import HybridConfig
from refstack.model.model import HybridModel
from refstack.model.tokenizer import ByteTokenizer

# The quality probe's shipped prompt set: fixed, plain ASCII, each fits the tiny context.
PROMPTS = load_prompts()[:10]
FLAGS = ("--cpu-kernels", "torch", "--dtype", "float32", "--torch-threads", "1")


def fp32_bound(logprob: float) -> float:
    """How far a TP run's logprob may be from the single rank's at fp32: the kernel lab's
    partition contract (examples/tp-numerics, ``FP32_LEVEL``: 3e-5 + 1e-5·|x| elementwise),
    "TP reproduces the single-device result up to fp32 summation order".  Why that covers
    a whole forward: TP changes only the association of sums (the row-parallel o_proj is
    a sum of 2 partial dot products of length 32 instead of one of 64; the experts' GEMMs
    run on other row groupings; the gather moves bytes), each a few fp32 ulps (2^-24
    relative) of O(1) activations; four layers of residual stream carry a few ulps on,
    and a log-softmax of |x| <= ~10 adds ~1e-6.  Measured: <= 2e-6."""
    return 3e-5 + 1e-5 * abs(logprob)


def echo(url: str) -> list[PromptLogprobs]:
    """Every prompt position's teacher-forced logprob and top-20 (the quality probe's request)."""
    out = []
    with httpx.Client(timeout=120) as client:
        for prompt in PROMPTS:
            r = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                                          "logprobs": 20, "temperature": 0})
            r.raise_for_status()
            out.append(parse_echo(r.json()))
    return out


def greedy(url: str, max_tokens: int = 16) -> list[list[str]]:
    """Each prompt's greedy completion as tokens (names, so invalid UTF-8 compares exactly)."""
    out = []
    with httpx.Client(timeout=120) as client:
        for prompt in PROMPTS:
            r = client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0, "logprobs": 0, "ignore_eos": True})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


@dataclass
class Difference:
    positions: int  # positions compared
    max_err: float  # largest |logprob difference| over every token both top-20s list
    worst_excess: float  # largest |difference| - fp32_bound: > 0 means outside the bound
    top1_flips: list[tuple[int, int, float]]  # (prompt, position, the single rank's top-2 gap there)
    excluded: int = 0  # positions not compared: at or after a routing near tie (``router_ties``)

    def describe(self) -> str:
        skipped = f" ({self.excluded} after a routing near tie not compared)" if self.excluded else ""
        return (f"{self.positions} positions{skipped}, max |logprob diff| {self.max_err:.3g}, "
                f"{len(self.top1_flips)} top-1 flips {self.top1_flips[:5]}")


def difference(single: list[PromptLogprobs], tp: list[PromptLogprobs],
               ties: Sequence[int | None] | None = None) -> Difference:
    """How far ``tp`` is from ``single``, position by position.  ``ties`` (``RouterTies.first``):
    in prompt p, the positions from ``ties[p]`` on are counted in ``excluded``, not compared."""
    positions, excluded, max_err, excess = 0, 0, 0.0, float("-inf")
    flips: list[tuple[int, int, float]] = []
    for p, (a, b) in enumerate(zip(single, tp)):
        assert a.tokens == b.tokens, "the same prompt tokenizes the same"
        tie = ties[p] if ties is not None else None
        for i, (ta, tb) in enumerate(zip(a.top, b.top)):
            if tie is not None and i >= tie:  # top[i]: the logits after token i
                excluded += 1
                continue
            positions += 1
            for tok in ta.keys() & tb.keys():
                err = abs(ta[tok] - tb[tok])
                max_err = max(max_err, err)
                excess = max(excess, err - fp32_bound(ta[tok]))
            if top1(ta) != top1(tb):
                ranked = sorted(ta.values(), reverse=True)
                flips.append((p, i, ranked[0] - ranked[1]))
    return Difference(positions, max_err, excess, flips, excluded)


def as_json(d: Difference) -> dict[str, Any]:
    return {"positions": d.positions, "max_err": d.max_err, "flips": len(d.top1_flips)}


# --- routing near ties ---------------------------------------------------------------
#
# Each MoE layer's router picks its top-k experts: the one discrete decision inside the
# forward.  TP changes the residual stream that reaches a router by a few fp32 ulps (the
# row-parallel o_proj's split sums, the experts' GEMMs over other row groupings), which
# moves the gap between its k-th and (k+1)-th logits by ~1e-7.  Where the gap is smaller,
# TP may route the token to another expert.  That is not rounding any more: the MoE output
# there changes by O(0.1) at any LM-head precision, and every later position of the
# sequence inherits it (the attention layers' KV and the KDA states hold it).  So a
# comparison leaves out each sequence's positions from its first near tie on and says how
# many.
#
# A router's k-th and (k+1)-th logits closer than ROUTER_TIE are a near tie.  Measured with
# both ranks in one process (the same shards, the same sums) over 620 seeds x 10 prompts
# (8.9M routing decisions): TP moved that gap by 1.5e-7 on average and 3.3e-6 at most, so
# 1e-5 is 3x the largest move.  The seed seen to flip one (774536173) had a gap of 3e-8.
# Over 1000 seeds, 72% have no near tie in the prompts, none more than 3 of the 10, and at
# most 16% of the positions are left out (1.5% on average).
ROUTER_TIE = 1e-5


@dataclass
class RouterTies:
    """Where the served model's routing is a near tie, along each prompt and its greedy
    continuation (one sequence: the prompt's tokens, then the single rank's greedy tokens)."""

    first: list[int | None]  # per prompt: the first token whose routing is a near tie in any MoE layer
    prompt_len: list[int]  # per prompt: its tokens (the greedy continuation starts there)
    min_gap: float  # the smallest k-th minus (k+1)-th router logit gap over every token and layer
    # Largest |logprob - the single server's echo| - fp32_bound: <= 0 when the rebuilt model is the served one.
    echo_excess: float

    @property
    def prompts(self) -> int:
        """How many prompts have a near tie (in the prompt or its greedy continuation)."""
        return sum(t is not None for t in self.first)

    def describe(self) -> str:
        at = [(p, t) for p, t in enumerate(self.first) if t is not None]
        return f"routing near ties (prompt, token) {at}, smallest router gap {self.min_gap:.3g}"


def _token_ids(tok: ByteTokenizer, vocab: int) -> dict[str, int]:
    ids = {tok.token_text(i): i for i in range(vocab)}
    assert len(ids) == vocab, "token texts name the ids one to one"
    return ids


def router_ties(seed: int, lm_head_precision: str, echo_single: list[PromptLogprobs],
                greedy_single: list[list[str]], margin: float = ROUTER_TIE) -> RouterTies:
    """Rebuild the served model (the tiny preset, ``seed``: the weights every rank builds) on
    torch's path, teacher-force each prompt and the single rank's greedy tokens, and find
    each sequence's first near tie in any MoE router.  ``echo_excess`` checks the rebuilt model
    against the single server's echo up to each first near tie (within the fp32 bound: the same
    model).  Pass a 3xtf32 or fp32 LM head's echo: a tf32 head turns the two runs' ulps (this
    forward runs the prompt in one piece, the server in prefill chunks) into 2^-10 jumps."""
    config = HybridConfig.preset("tiny").with_overrides(seed=seed, lm_head_precision=lm_head_precision)
    model = HybridModel(config)
    tokenizer = ByteTokenizer()
    ids_of = _token_ids(tokenizer, config.vocab_size)
    masked = unsampleable_ids(tokenizer, config.vocab_size)  # the server's logprobs leave these out
    k = config.num_experts_per_tok
    gaps: list[torch.Tensor] = []  # per MoE layer: [tokens] its router's k-th minus (k+1)-th logit

    def record(_module: Any, _inputs: Any, logits: torch.Tensor) -> None:
        ranked = logits.topk(k + 1, dim=-1).values
        gaps.append(ranked[:, k - 1] - ranked[:, k])

    hooks = [block.moe.router.register_forward_hook(record) for block in model.layers]
    first: list[int | None] = []
    lens: list[int] = []
    min_gap, echo_excess = float("inf"), float("-inf")
    try:
        for echo_p, greedy_p in zip(echo_single, greedy_single):
            prompt = [ids_of[t] for t in [echo_p.first_token, *echo_p.tokens]]
            seq = prompt + [ids_of[t] for t in greedy_p]
            gaps.clear()
            _, rows = model.forward_chunks_all_positions([SeqChunk(slot=0, token_ids=seq, start_pos=0)],
                                                         model.new_cache(1), [0])
            gap = torch.stack(gaps).amin(dim=0)  # [tokens]: the smallest gap over the layers
            tied = (gap < margin).nonzero()
            first.append(int(tied[0, 0]) if len(tied) else None)
            lens.append(len(prompt))
            min_gap = min(min_gap, float(gap.min()))
            logprobs = torch.log_softmax(rows[0].masked_fill(masked, float("-inf")), dim=-1)
            # top[i]: the logits after token i.  From a near tie on, this forward (one chunk,
            # not the server's prefill pieces) may route differently from the server too.
            for i, top in enumerate(echo_p.top[: first[-1]]):
                for tok, value in top.items():
                    echo_excess = max(echo_excess, abs(float(logprobs[i, ids_of[tok]]) - value) - fp32_bound(value))
    finally:
        for h in hooks:
            h.remove()
    return RouterTies(first, lens, min_gap, echo_excess)


def greedy_agree(single: list[list[str]], tp: list[list[str]], ties: RouterTies) -> tuple[bool, int]:
    """Whether the greedy tokens agree up to each sequence's first near tie (a token chosen
    from the logits after a near-tied token may differ), and how many tokens were compared."""
    compared, same = 0, True
    for p, (a, b) in enumerate(zip(single, tp)):
        tie = ties.first[p]
        # Generated token j is chosen from the logits after token prompt_len - 1 + j.
        n = len(a) if tie is None else max(0, min(len(a), tie - ties.prompt_len[p] + 1))
        compared += n
        same = same and a[:n] == b[:n] and len(a) == len(b)
    return same, compared
