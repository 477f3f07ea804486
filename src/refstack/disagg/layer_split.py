"""Layer Split: the prefill side sends layer i's KV rows (or KDA state) while the model
computes layer i+1 (``kv_transfer_granularity = layer``), as layer-wise KV connectors do
(LMCache's layerwise mode, vLLM's ``save_kv_layer``).

A forward hook on every decoder layer (``nn.Module.register_forward_hook``: the model
needs no change) fires when the layer's output is computed, and by then the layer has
written its cache: the attention layer its K and V rows, the KDA layer its recurrent
state.  For each prefill chunk of the forward, the hook hands that layer's rows of the
chunk to ``send`` (views of the request's slot; what ``send`` does with them, pack on the
engine thread or queue for the transfer thread, is the prefill engine's business): an
attention layer's K and V at the chunk's positions, and, in the chunk that completes the
prompt, a KDA layer's state (final only then).  A chunked prompt's earlier chunks thus
leave during the steps after them, and the last chunk's rows complete every layer.

A forward that bypasses the modules (the native decode step, taken when every chunk is
one token: a one-token prompt) fires no hook; its layers are sent after the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from refstack.disagg.pages import Snapshot, block_keys, capture_layer
from refstack.model.cache import ModelCache

# (request id, model layer, that layer's rows or state, first and end position, prompt length, block keys)
SendLayer = Callable[[str, int, Snapshot, int, int, int, list[bytes]], None]


@dataclass(slots=True)
class LayerTarget:
    """A prefill chunk of the running forward."""

    rid: str
    slot: int
    p0: int  # the chunk's positions [p0, p1)
    p1: int
    length: int  # the prompt's
    final: bool  # the chunk completes the prompt
    keys: list[bytes]
    sent: set[int] = field(default_factory=set)


class LayerSplit:
    """The forward hooks and the requests they send for; see the module docstring."""

    def __init__(self, model: Any, cache: ModelCache, page_tokens: int, send: SendLayer) -> None:
        self.cache = cache
        self.page_tokens = page_tokens
        self.num_layers = len(model.layers)
        self._send = send
        self._targets: list[LayerTarget] = []
        self.started: dict[str, list[bytes]] = {}  # requests with rows sent and no handoff or drop yet: block keys
        self._handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(model.layers)]

    def run(self, forward: Callable[[], torch.Tensor],
            chunks: list[tuple[str, int, int, int, list[int]]]) -> torch.Tensor:
        """``forward()`` with each layer of ``chunks`` (rid, slot, first position, end position,
        prompt ids) sent as soon as the layer is computed."""
        self._targets = []
        for rid, slot, p0, p1, ids in chunks:
            keys = self.started.get(rid)
            if keys is None:
                keys = self.started[rid] = block_keys(ids, len(ids), self.page_tokens)
            self._targets.append(LayerTarget(rid, slot, p0, p1, len(ids), p1 == len(ids), keys))
        try:
            logits = forward()
            for t in self._targets:  # layers no hook saw (a forward that bypassed the modules)
                for layer in range(self.num_layers):
                    if layer not in t.sent:
                        self._send_layer(t, layer)
            return logits
        finally:
            self._targets = []

    def done(self, rid: str) -> bool:
        """Forget ``rid`` (handed off or dropped); True if it had rows sent."""
        return self.started.pop(rid, None) is not None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, layer: int) -> Callable[..., None]:
        def after_layer(_module: Any, _args: Any, _output: Any) -> None:
            for t in self._targets:
                self._send_layer(t, layer)
        return after_layer

    def _send_layer(self, t: LayerTarget, layer: int) -> None:
        t.sent.add(layer)
        if layer in self.cache.keys:
            self._send(t.rid, layer, capture_layer(self.cache, t.slot, layer, t.p0, t.p1), t.p0, t.p1, t.length, t.keys)
        elif t.final:  # a KDA state is final only after the prompt's last chunk
            self._send(t.rid, layer, capture_layer(self.cache, t.slot, layer, 0, t.length), 0, t.length, t.length,
                       t.keys)
