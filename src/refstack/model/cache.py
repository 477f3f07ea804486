"""Per-sequence memory, addressed by slot: KV caches and KDA recurrent states."""

from __future__ import annotations

import torch
from torch import Tensor

from refstack.model.config import HybridConfig


class ModelCache:
    """KV slots for the attention layers and state slots for the KDA layers.

    A slot belongs to one sequence at a time; the engine allocates slots and calls
    :meth:`reset_slot` when it hands one to a new sequence.  (The model also ignores
    stale contents at ``start_pos == 0``, so a forgotten reset cannot leak a previous
    sequence into a new one.)
    """

    def __init__(self, config: HybridConfig, num_slots: int, max_seq_len: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if num_slots <= 0:
            raise ValueError(f"ModelCache: num_slots must be positive, got {num_slots}")
        if not 0 < max_seq_len <= config.max_seq_len:
            raise ValueError(
                f"ModelCache: max_seq_len must be in 1..{config.max_seq_len} (the config's), got {max_seq_len}"
            )
        self.config = config
        self.device = torch.device(device)  # the model's: every layer reads and writes these in place
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        # Layout [slot, kv_head, position, head_dim]: a slot's prefix [:, :L] is what
        # scaled_dot_product_attention takes directly, without a transpose copy.
        kv_shape = (num_slots, config.num_kv_heads, max_seq_len, config.head_dim)
        state_shape = (num_slots, config.kda_num_heads, config.kda_head_k_dim, config.kda_head_v_dim)
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.states: dict[int, Tensor] = {}
        for layer in range(config.num_layers):
            if config.is_full_attention(layer):
                self.keys[layer] = torch.zeros(kv_shape, device=self.device)
                self.values[layer] = torch.zeros(kv_shape, device=self.device)
            else:
                self.states[layer] = torch.zeros(state_shape, device=self.device)

    def reset_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"reset_slot: slot {slot} outside 0..{self.num_slots - 1}")
        # Only the recurrent state needs clearing: attention masks never read KV
        # positions a sequence has not written.
        with torch.inference_mode():
            for state in self.states.values():
                state[slot].zero_()

    def reset(self) -> None:
        for slot in range(self.num_slots):
            self.reset_slot(slot)

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values(), *self.states.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def bytes_per_slot(self) -> int:
        return self.nbytes // self.num_slots
