"""The truth for ``kda_decode``: the same step in float64 torch (no Triton import).

Kept apart from the kernel module so tests, the kernel lab and benches can build the
reference on a machine without Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def kda_decode_reference(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, state: Tensor, slots: Tensor, *,
                         A_log: Tensor, dt_bias: Tensor | None = None, scale: float | None = None,
                         eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Returns (o [N, H, V] in v's dtype, the new states [N, H, K, V] fp32) for rows ``slots``.

    Leaves ``state`` untouched; written straight from the recurrence, in float64.
    """
    N, H, K = q.shape
    qd, kd, fd = q.double(), k.double(), f.double()
    qn = qd / torch.sqrt((qd * qd).sum(-1, keepdim=True) + eps)
    kn = kd / torch.sqrt((kd * kd).sum(-1, keepdim=True) + eps)
    if dt_bias is not None:
        fd = fd + dt_bias.double().view(H, K)
    g = -torch.exp(A_log.double()).view(H, 1) * F.softplus(fd)
    beta = torch.sigmoid(b.double())
    s = state.index_select(0, slots.long()).double() * torch.exp(g)[..., None]
    predicted = torch.einsum("nhkv,nhk->nhv", s, kn)
    s = s + kn[..., None] * (beta[..., None] * (v.double() - predicted))[..., None, :]
    o = torch.einsum("nhkv,nhk->nhv", s, qn) * (K**-0.5 if scale is None else scale)
    return o.to(v.dtype), s.float()


SLOT_ORDERS = ("shuffled", "ascending")


def kda_decode_inputs(N: int, H: int, K: int, V: int, *, num_slots: int | None = None, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu", seed: int = 0, slot_order: str = "shuffled") -> dict[str, Tensor]:
    """Random decode inputs with the case study's conventions: raw q/k/f/b, a random slot map.

    ``slot_order="shuffled"``: sequence n lives in an arbitrary slot.  ``"ascending"``: the
    same random subset of the pool, sorted, which is what refstack's engine presents (it
    orders its decode batch by slot; finished sequences leave holes).
    """
    if slot_order not in SLOT_ORDERS:
        raise ValueError(f"kda_decode_inputs: slot_order must be one of {SLOT_ORDERS}, got {slot_order!r}")
    g = torch.Generator().manual_seed(seed)
    S = num_slots if num_slots is not None else N
    inputs = {
        "q": torch.randn(N, H, K, generator=g),
        "k": torch.randn(N, H, K, generator=g),
        "v": torch.randn(N, H, V, generator=g),
        "f": torch.randn(N, H, K, generator=g),
        "b": torch.randn(N, H, generator=g),
    }
    out = {name: t.to(device=device, dtype=dtype) for name, t in inputs.items()}
    out["A_log"] = torch.log(1.0 + 7.0 * torch.rand(H, generator=g)).to(device)
    out["dt_bias"] = (0.1 * torch.randn(H * K, generator=g)).to(device)
    # The state pool is the bulk of the bytes (2 GiB at N=512 with twice as many slots):
    # drawn where it lives, so a GPU run does not wait seconds on a CPU generator and a
    # host-to-device copy.  Seeded, so still reproducible on each device type.
    dev = torch.device(device)
    g_state = torch.Generator(device=dev).manual_seed(seed)
    out["state"] = 0.1 * torch.randn(S, H, K, V, generator=g_state, device=dev)
    # Continuous batching: sequence n lives in an arbitrary slot of the pool.
    slots = torch.randperm(S, generator=g)[:N]
    if slot_order == "ascending":
        slots = torch.sort(slots).values
    out["slots"] = slots.to(device=device, dtype=torch.int32)
    return out
