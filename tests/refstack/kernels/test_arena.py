"""Packed weights on huge pages: same bytes, one mapping advised for 2 MiB pages.

Whether the kernel then backs it with huge pages depends on its THP setting and on
fragmentation, so the tests check the advice (``hg`` in the mapping's VmFlags), not
AnonHugePages.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from refstack.kernels import arena
from refstack.model import HybridConfig, HybridModel, SeqChunk

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not arena.huge_pages_supported(),
                                reason="needs Linux (MADV_HUGEPAGE, /proc/self/smaps)")


def _mapping_of(address: int) -> tuple[int, set[str]]:
    """(start, VmFlags) of the mapping holding ``address``, from /proc/self/smaps."""
    text = Path("/proc/self/smaps").read_text()
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) [^\n]*\n((?:[A-Za-z_]+:[^\n]*\n)+)", text, re.MULTILINE):
        if int(m.group(1), 16) <= address < int(m.group(2), 16):
            flags = re.search(r"^VmFlags:(.*)$", m.group(3), re.MULTILINE)
            return int(m.group(1), 16), set(flags.group(1).split()) if flags else set()
    raise AssertionError(f"no mapping holds {address:#x}")


def _skip_unless_moved(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    if all(a is b for a, b in zip(after, before)):
        pytest.skip("this kernel refused MADV_HUGEPAGE (no THP): the tensors stay where they are")


def test_copies_are_equal_aligned_and_share_one_mapping_advised_for_huge_pages() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(512, 300, generator=gen), torch.randn(3, 7, generator=gen).to(torch.bfloat16),
               torch.arange(10, dtype=torch.int64), torch.randn(1024, 1024, generator=gen)]
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        arena.to_huge_pages([torch.randn(4, 4).t()])
    moved = arena.to_huge_pages(tensors)
    _skip_unless_moved(tensors, moved)
    for before, after in zip(tensors, moved):
        assert torch.equal(before, after) and after.dtype == before.dtype and after.is_contiguous()
        assert after.data_ptr() % arena.ALIGN == 0 and after.data_ptr() != before.data_ptr()
    assert moved[0].data_ptr() % arena.HUGE_PAGE == 0
    starts = {_mapping_of(t.data_ptr())[0] for t in moved}
    assert len(starts) == 1 and "hg" in _mapping_of(moved[0].data_ptr())[1]  # one mapping, MADV_HUGEPAGE set
    del tensors
    moved[3].add_(1.0)  # the mapping outlives the originals and is writable


def test_model_packed_weights_move_and_the_logits_stay_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = [torch.ones(1)]
    _skip_unless_moved(probe, arena.to_huge_pages(probe))
    on_pages = HybridModel(HybridConfig.preset("tiny", dtype="bfloat16"))
    on_pages.use_native_kernels(True)
    monkeypatch.setattr("refstack.model.model.to_huge_pages", list)  # leave them where torch put them
    plain = HybridModel(HybridConfig.preset("tiny", dtype="bfloat16"))
    plain.use_native_kernels(True)
    logits = []
    for m in (on_pages, plain):
        cache = m.new_cache(2)
        out = [m.forward_chunks([SeqChunk(0, [1, 2, 3, 4, 5], 0), SeqChunk(1, [9, 8, 7], 0)], cache)]
        out.append(m.forward_chunks([SeqChunk(0, [6], 5), SeqChunk(1, [6], 3)], cache))  # the native decode step
        logits.append(torch.cat(out))
    assert torch.equal(logits[0], logits[1])
    packed = [getattr(m, a) for m in on_pages.modules() for a in ("packed", "low_rank_packed")
              if getattr(m, a, None) is not None]
    tensors = [t for p in packed for t in (p if isinstance(p, tuple) else (p,))]
    assert any(isinstance(getattr(m, "low_rank_packed", None), torch.Tensor) for m in on_pages.modules())
    mappings = {_mapping_of(t.data_ptr())[0] for t in tensors}
    assert len(tensors) > 10 and len(mappings) == 1  # every packed weight (experts, low-rank ups too), one mapping
    assert "hg" in _mapping_of(tensors[0].data_ptr())[1] and min(t.data_ptr() for t in tensors) % arena.HUGE_PAGE == 0
