"""Weight layouts the native CPU kernels read: packing, and the tagged-pack format.

Pure torch, no native call: ``cpu_kernels`` (the calls) and ``cpu_blocks`` (whole decode
blocks) check their weights against these layouts, and ``refstack.model`` packs its weights
with them once at load time.

- **fp32**: a weight [K, N] as contiguous column blocks [ceil(N/NB), K, NB] (``pack``), NB
  columns per block (``cpu_build.BLOCK_COLS``), zero-padded;
- **bf16**: the same blocks as k-pairs [ceil(N/NB), ceil(K/2), NB, 2] (``vdpbf16ps`` reads two
  k per lane);
- **experts**: gate|up interleaved per half block so a tile ends in silu(gate) * up
  (``pack_gate_up``), down as one pack per expert (``pack_down``);
- **tagged** (W8A8, ``cpu_int8.c``): a 1-d int8 tensor that starts with a 64-byte header
  (format, K, N, section offsets).  ``pack_w8a8`` / ``pack_gate_up_w8a8`` /
  ``pack_down_w8a8`` hold int8 blocks [ceil(N/NB)][ceil(K/4)][NB][4], fp32 column scales,
  int32 column corrections (128 * column sums: the unsigned-operand offset of
  ``vpdpbusd``) and an optional fp32 1/s; ``pack(..., tagged=True)`` puts an fp32 or bf16
  pack behind the same header, so one native decode block can mix both.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from refstack.kernels.cpu_build import BLOCK_COLS as NB

__all__ = [
    "FORMAT_BF16", "FORMAT_FP32", "FORMAT_W8A8", "HALF", "HEADER_BYTES", "NB", "check_packed", "fits", "gemm_kind",
    "is_tagged", "pack", "pack_down", "pack_down_w8a8", "pack_gate_up", "pack_gate_up_w8a8", "pack_w8a8", "packed_k",
    "read_header", "to_pairs",
]

HALF = NB // 2  # an expert block's gate (or up) columns


def check_packed(name: str, *tensors: Tensor) -> None:
    """fp32 packs end in [..., K, NB]; bf16 packs in [..., K2, NB, 2] (see ``pack``); tagged packs are 1-d int8."""
    for t in tensors:
        if is_tagged(t) and t.device.type == "cpu" and t.is_contiguous() and t.numel() >= HEADER_BYTES:
            continue
        fp32 = t.dtype == torch.float32 and t.shape[-1] == NB
        bf16 = t.dtype == torch.bfloat16 and t.dim() >= 2 and t.shape[-2:] == (NB, 2)
        if not (fp32 or bf16) or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: packed weights must be contiguous CPU fp32 [..., K, {NB}] or bf16 [..., K/2, {NB}, 2] "
                             f"blocks, got {t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()}); pack them with this module")


def packed_k(t: Tensor) -> int:
    """The reduction length a packed weight covers (bf16 packs hold K in pairs, rounded up)."""
    return t.shape[-2] if t.dtype == torch.float32 else 2 * t.shape[-3]


def to_pairs(blocks: Tensor) -> Tensor:
    """fp32 blocks [..., K, NB] as bf16 k-pairs [..., ceil(K/2), NB, 2], a zero row past an odd K."""
    K = blocks.shape[-2]
    if K % 2:
        blocks = torch.cat([blocks, blocks.new_zeros(*blocks.shape[:-2], 1, NB)], dim=-2)
    pairs = blocks.to(torch.bfloat16).unflatten(-2, (-1, 2))  # [..., K2, 2, NB]
    return pairs.transpose(-1, -2).contiguous()


def fits(packed: Tensor, k: int) -> bool:
    return packed.shape[-2] == k if packed.dtype == torch.float32 else packed.shape[-3] == -(-k // 2)


def pack(w: Tensor, dtype: torch.dtype = torch.float32, *, tagged: bool = False) -> Tensor:
    """A weight [K, N] (any strides) as contiguous column blocks [ceil(N/NB), K, NB], zero-padded;
    with ``dtype=torch.bfloat16``, rounded to bf16 as [ceil(N/NB), ceil(K/2), NB, 2].
    ``tagged``: the same blocks behind a W8A8-style header (a 1-d int8 tensor; see the module doc)."""
    K, N = w.shape
    nb = -(-N // NB)
    padded = w.new_zeros(K, nb * NB)
    padded[:, :N] = w
    blocks = padded.view(K, nb, NB).transpose(0, 1).contiguous()
    blocks = to_pairs(blocks) if dtype == torch.bfloat16 else blocks
    if not tagged:
        return blocks
    payload = blocks.reshape(-1).view(torch.int8)
    fmt = FORMAT_BF16 if dtype == torch.bfloat16 else FORMAT_FP32
    total = HEADER_BYTES + payload.numel()
    return torch.cat([_header(fmt, K, N, HEADER_BYTES, 0, 0, 0, total), payload])


# ---------------------------------------------------------------- W8A8 (cpu_int8.c)
HEADER_BYTES = 64
_MAGIC = 0x38575352  # "RSW8"
FORMAT_FP32, FORMAT_BF16, FORMAT_W8A8 = 0, 1, 2
_HEADER = struct.Struct("<ii7q")


def is_tagged(t: Tensor) -> bool:
    """A tagged pack: a 1-d int8 tensor that starts with the 64-byte header."""
    return t.dtype == torch.int8 and t.dim() == 1


def gemm_kind(dtype: torch.dtype | None) -> int:
    """The native blocks' weight kind for packs of ``dtype``: 0 fp32 (or None), 1 bf16, 2 tagged (int8)."""
    return {torch.bfloat16: 1, torch.int8: 2}.get(dtype, 0) if dtype is not None else 0


def _header(fmt: int, K: int, N: int, off_w: int, off_scale: int, off_corr: int, off_inv_s: int, total: int) -> Tensor:
    raw = bytearray(HEADER_BYTES)
    _HEADER.pack_into(raw, 0, _MAGIC, fmt, K, N, off_w, off_scale, off_corr, off_inv_s, total)
    return torch.frombuffer(raw, dtype=torch.int8).clone()


def read_header(pack: Tensor) -> dict[str, int]:
    """A tagged pack's header fields (``format``, ``K``, ``N``, the offsets, ``total``)."""
    if not is_tagged(pack) or pack.numel() < HEADER_BYTES:
        raise ValueError(f"read_header: expected a 1-d int8 tagged pack, got {pack.dtype} {tuple(pack.shape)}")
    fields = _HEADER.unpack(pack[:HEADER_BYTES].numpy().tobytes()[: _HEADER.size])
    if fields[0] != _MAGIC:
        raise ValueError("read_header: not a tagged pack (bad magic)")
    return dict(zip(("magic", "format", "K", "N", "off_w", "off_scale", "off_corr", "off_inv_s", "total"), fields))


def _align(n: int) -> int:
    return -(-n // 64) * 64


def pack_w8a8(qweight: Tensor, scale: Tensor, inv_s: Tensor | None = None) -> Tensor:
    """A W8A8 weight for ``gemm``: ``qweight`` [N, K] int8 (rows: output channels), ``scale`` [N]
    fp32 per output channel, ``inv_s`` [K] fp32 activation multipliers (None: none).  Returns the
    tagged pack: header, int8 [ceil(N/NB)][ceil(K/4)][NB][4], scales, 128 * column sums, inv_s."""
    N, K = qweight.shape
    if qweight.dtype != torch.int8 or scale.shape != (N,) or (inv_s is not None and inv_s.shape != (K,)):
        raise ValueError(f"pack_w8a8: qweight {qweight.dtype} {tuple(qweight.shape)}, scale {tuple(scale.shape)}, "
                         f"inv_s {None if inv_s is None else tuple(inv_s.shape)} do not fit")
    nb, K4 = -(-N // NB), -(-K // 4)
    q = torch.zeros(nb * NB, K4 * 4, dtype=torch.int8)
    q[:N, :K] = qweight.cpu()
    blocks = q.view(nb, NB, K4, 4).permute(0, 2, 1, 3).contiguous().view(-1)  # [nb][K4][NB][4]
    sw = torch.zeros(nb * NB, dtype=torch.float32)
    sw[:N] = scale.float().cpu()
    corr = (q.to(torch.int32).sum(1) * 128).to(torch.int32)
    off_w = HEADER_BYTES
    off_scale = _align(off_w + blocks.numel())
    off_corr = _align(off_scale + 4 * nb * NB)
    off_inv = _align(off_corr + 4 * nb * NB) if inv_s is not None else 0
    total = _align((off_inv + 4 * K) if inv_s is not None else (off_corr + 4 * nb * NB))
    out = torch.zeros(total, dtype=torch.int8)
    out[:HEADER_BYTES] = _header(FORMAT_W8A8, K, N, off_w, off_scale, off_corr, off_inv, total)
    out[off_w : off_w + blocks.numel()] = blocks
    out[off_scale : off_scale + 4 * nb * NB] = sw.view(torch.int8)
    out[off_corr : off_corr + 4 * nb * NB] = corr.view(torch.int8)
    if inv_s is not None:
        out[off_inv : off_inv + 4 * K] = inv_s.float().cpu().contiguous().view(torch.int8)
    return out


def pack_gate_up_w8a8(qweight: Tensor, scale: Tensor, inv_s: Tensor | None = None) -> Tensor:
    """Experts' gate|up as W8A8: ``qweight`` [E, 2I, D] int8 (gate rows, then up), ``scale`` [E, 2I],
    ``inv_s`` [E, D] or None.  Each expert's pack has its columns in ``pack_gate_up``'s order
    (block j: gate 16j.. | up 16j..), so a tile ends in silu(gate) * up; the packs are back to back."""
    E, two_i = qweight.shape[:2]
    inner = two_i // 2
    if inner % HALF:
        raise ValueError(f"pack_gate_up_w8a8: expert hidden size {inner} is not a multiple of {HALF}")
    order = torch.arange(two_i).view(2, inner // HALF, HALF).transpose(0, 1).reshape(-1)  # gate block j, up block j
    return torch.cat([pack_w8a8(qweight[e][order], scale[e][order], None if inv_s is None else inv_s[e])
                      for e in range(E)])


def pack_down_w8a8(qweight: Tensor, scale: Tensor, inv_s: Tensor | None = None) -> Tensor:
    """Experts' down projections as W8A8: ``qweight`` [E, D, I] int8, ``scale`` [E, D], ``inv_s`` [E, I] or None."""
    return torch.cat([pack_w8a8(qweight[e], scale[e], None if inv_s is None else inv_s[e])
                      for e in range(qweight.shape[0])])

def pack_gate_up(w_gate_up: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Experts' [E, D, 2I] (gate columns, then up) as [E, I/16, D, 32]: block j holds gate
    columns 16j..16j+15 then the matching up columns, so a tile ends in silu(gate) * up.
    bf16: [E, I/16, ceil(D/2), 32, 2] (see ``pack``)."""
    E, D, two_i = w_gate_up.shape
    inner = two_i // 2
    if inner % HALF:
        raise ValueError(f"pack_gate_up: expert hidden size {inner} is not a multiple of {HALF}")
    gate = w_gate_up[..., :inner].reshape(E, D, inner // HALF, HALF)
    up = w_gate_up[..., inner:].reshape(E, D, inner // HALF, HALF)
    blocks = torch.cat([gate, up], dim=-1).permute(0, 2, 1, 3).contiguous()
    return to_pairs(blocks) if dtype == torch.bfloat16 else blocks


def pack_down(w_down: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Experts' [E, I, D] as [E, ceil(D/NB), I, NB] (bf16: [E, ceil(D/NB), I/2, NB, 2])."""
    return torch.stack([pack(w, dtype) for w in w_down.unbind(0)])
