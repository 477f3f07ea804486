from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra_agent.errors import ConfigError
from infra_agent.serving.datasets import (
    ByteTokenizer,
    jsonl_requests,
    random_requests,
    shared_prefix_requests,
)


def test_random_lengths_are_exact_server_tokens_with_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    reqs = random_requests(50, input_len=100, output_len=20, range_ratio=0.5, seed=1)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert len(tok.encode(r.prompt)) == r.prompt_len
        assert 50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30
    assert len({r.prompt_len for r in reqs}) > 10  # the range ratio spreads them
    same = random_requests(50, 100, 20, 0.5, seed=1)
    assert [r.prompt for r in same] == [r.prompt for r in reqs]
    fixed = random_requests(5, 64, 8)
    assert all(r.prompt_len == 64 and r.output_len == 8 for r in fixed)


def test_shared_prefix_groups() -> None:
    reqs = shared_prefix_requests(12, num_prefixes=3, prefix_len=40, suffix_len=10, output_len=4, seed=2)
    prefixes = {r.prompt[:40] for r in reqs}  # type: ignore[index]
    assert len(prefixes) == 3
    assert all(r.prompt_len == 50 for r in reqs)
    assert len({r.prompt for r in reqs}) == 12


def test_jsonl_prompts(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in [{"prompt": "hello"}, {"prompt": "hi", "max_tokens": 3}, {"text": "abc"}][:2]) + "\n")
    reqs = jsonl_requests(f, 5, default_output_len=7)
    assert len(reqs) == 5
    assert {(r.prompt, r.prompt_len, r.output_len) for r in reqs} == {("hello", 5, 7), ("hi", 2, 3)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="line 1"):
        jsonl_requests(bad, 1)
