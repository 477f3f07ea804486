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

_frozen_here = 0  # objects this module's freezes moved, process-wide as the collector is


def freeze_heap() -> int:
    """Collect once, then freeze every object alive: later collections, including the
    full ones, walk only what was allocated since.  Process-wide, as the collector is.
    Returns how many objects this call moved out of the collector's reach."""
    global _frozen_here
    gc.collect()
    before = gc.get_freeze_count()
    gc.freeze()
    _unfreeze_at_exit()
    moved = gc.get_freeze_count() - before
    _frozen_here += moved
    return moved


def frozen_by_refstack() -> int:
    """How many objects refstack's own freezes moved (some may have been freed since).  A
    library may freeze objects of its own: the process-wide ``gc.get_freeze_count()``
    counts those too."""
    return _frozen_here


@functools.cache
def _unfreeze_at_exit() -> None:
    # Back into the collector's reach at exit, so shutdown collects them as it would have
    # (extension types that count their live instances, nanobind's in triton, otherwise
    # report the frozen ones as leaked).  Registered once per process.
    atexit.register(gc.unfreeze)
