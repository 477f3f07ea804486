"""Freezing the startup heap out of Python's cyclic garbage collector (``--gc-freeze``).

A full collection walks every tracked object of the process.  After startup most of
them live for the whole run (the model's modules and tensors, torch's and the web
stack's imports), and walking them cost 80-135 ms per full collection on ``small``,
stalling the step it landed in.  ``gc.freeze`` moves them out of every later
collection, as vLLM and SGLang do after startup (docs/refstack.md, "GC pauses").
"""

from __future__ import annotations

import atexit
import functools
import gc


def freeze_heap() -> None:
    """Collect once, then freeze every object alive: later collections, including the
    full ones, walk only what was allocated since.  Process-wide, as the collector is."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    # Back into the collector's reach at exit, so shutdown collects them as it would have
    # (extension types that count their live instances, nanobind's in triton, otherwise
    # report the frozen ones as leaked).  Registered once per process.
    atexit.register(gc.unfreeze)
