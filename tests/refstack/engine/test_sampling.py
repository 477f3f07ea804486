"""Sampling primitives: greedy, top-p, per-request generators; stop-string matching."""

from __future__ import annotations

import torch

from refstack.engine.sampling import SamplingParams, StopMatcher, _top_p_filter, make_generator, sample_tokens


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    params = [SamplingParams(temperature=0.0)] * 2
    assert sample_tokens(logits, params, [make_generator(0)] * 2) == [1, 0]


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    kept = _top_p_filter(probs, 0.7)  # 0.5 alone is short of 0.7; 0.5 + 0.3 reaches it
    assert torch.allclose(kept, torch.tensor([0.0, 0.625, 0.375, 0.0]))
    assert torch.equal(_top_p_filter(probs, 1e-9) > 0, torch.tensor([False, True, False, False]))


def test_a_row_draw_depends_on_its_own_generator_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    hot = SamplingParams(temperature=1.0, seed=1)
    alone = sample_tokens(logits[1:2], [hot], [make_generator(11)])
    mixed = sample_tokens(logits, [SamplingParams(temperature=0.0), hot, SamplingParams(temperature=0.5)],
                          [make_generator(5), make_generator(11), make_generator(6)])
    assert mixed[1] == alone[0]
    draws = {tuple(sample_tokens(logits, [hot] * 3, [make_generator(s) for s in (s0, s0 + 1, s0 + 2)]))
             for s0 in range(0, 30, 3)}
    assert len(draws) > 1  # different seeds do give different draws


def test_stop_matcher_finds_and_holds_back() -> None:
    m = StopMatcher(("END", "\n\n"))
    assert m.find("abc EN", 0) == -1
    assert m.safe_len("abc EN") == 4  # "EN" could become "END": hold it back
    assert m.find("abc END more", 4) == 4
    assert m.find("x\n\ny", 0) == 1
    assert m.safe_len("abc") == 3
    assert StopMatcher(()).safe_len("anything") == len("anything")
