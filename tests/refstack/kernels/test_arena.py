"""Packed weights on huge pages: same bytes, one mapping, 2 MiB pages where the OS has them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from refstack.kernels import arena
from refstack.model import HybridConfig, HybridModel, SeqChunk

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The active THP mode ('always', 'madvise', 'never'), or None off Linux."""
    if not THP.exists():
        return None
    return re.search(r"\[(\w+)\]", THP.read_text()).group(1)  # type: ignore[union-attr]


def _mapping_of(address: int) -> tuple[int, int]:
    """(start, AnonHugePages KiB) of the mapping holding ``address``, from /proc/self/smaps."""
    text = Path("/proc/self/smaps").read_text()
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) [^\n]*\n((?:[A-Za-z_]+:[^\n]*\n)+)", text, re.MULTILINE):
        if int(m.group(1), 16) <= address < int(m.group(2), 16):
            return int(m.group(1), 16), int(re.search(r"AnonHugePages:\s+(\d+) kB", m.group(3)).group(1))  # type: ignore[union-attr]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not arena.huge_pages_supported(), reason="needs mmap.MADV_HUGEPAGE (Linux)")
def test_copies_are_equal_aligned_and_share_one_huge_page_mapping() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(512, 300, generator=gen), torch.randn(3, 7, generator=gen).to(torch.bfloat16),
               torch.arange(10, dtype=torch.int64), torch.randn(1024, 1024, generator=gen)]
    moved = arena.to_huge_pages(tensors)
    assert len({_mapping_of(t.data_ptr())[0] for t in moved}) == 1
    for before, after in zip(tensors, moved):
        assert torch.equal(before, after) and after.dtype == before.dtype and after.is_contiguous()
        assert after.data_ptr() % arena.ALIGN == 0 and after.data_ptr() != before.data_ptr()
    assert moved[0].data_ptr() % arena.HUGE_PAGE == 0
    if _thp_mode() in ("always", "madvise"):
        assert _mapping_of(moved[3].data_ptr())[1] >= 2048  # the 4 MiB tensor sits on at least one huge page
    del tensors
    moved[3].add_(1.0)  # the mapping outlives the originals and is writable
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        arena.to_huge_pages([torch.randn(4, 4).t()])


def test_model_logits_are_the_same_wherever_the_packed_weights_live(monkeypatch: pytest.MonkeyPatch) -> None:
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
    if arena.huge_pages_supported():
        packed = [m.packed for m in on_pages.modules() if getattr(m, "packed", None) is not None]
        ptrs = [t.data_ptr() for p in packed for t in (p if isinstance(p, tuple) else (p,))]
        assert len(ptrs) > 10 and len({_mapping_of(a)[0] for a in ptrs}) == 1  # every packed weight, one mapping
