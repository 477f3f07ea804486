"""The code a running frame belongs to, as a change would name it.

A collection of the cyclic garbage collector starts inside whatever allocation crossed
its threshold, so the Python frame below the collector's callback is the code that
allocated.  Under allocation churn that is the code that churns, which is what a
``gc`` span records beside its generation (``function``, ``where``).  The frame itself
may be the standard library's (``json.dumps`` building a list) or a comprehension's
own (``<genexpr>``, a frame of its own up to Python 3.11): neither is code a change
edits, so the site is the innermost frame outside both.
"""

from __future__ import annotations

import functools
import os
from types import FrameType

_COMPREHENSIONS = frozenset({"<genexpr>", "<listcomp>", "<setcomp>", "<dictcomp>", "<lambda>"})


@functools.cache
def _stdlib_dir() -> str:
    import sysconfig

    return os.path.join(sysconfig.get_paths()["stdlib"], "")


def _in_stdlib(path: str, stdlib: str) -> bool:
    # An install outside a virtual environment keeps its site-packages inside the stdlib folder.
    return path.startswith(stdlib) and not path[len(stdlib):].startswith(("site-packages", "dist-packages"))


def allocating_site(frame: FrameType | None) -> dict[str, str]:
    """``function`` (qualified, ``Engine._sample``) and ``where`` (file:line) of the innermost
    frame from ``frame`` outwards that is neither the standard library's nor a comprehension's
    ({} without a frame); ``frame`` itself when every frame is."""
    stdlib, first = _stdlib_dir(), frame
    while frame is not None:
        code = frame.f_code
        if code.co_name not in _COMPREHENSIONS and not _in_stdlib(code.co_filename, stdlib):
            break
        frame = frame.f_back
    frame = frame or first
    if frame is None:
        return {}
    code = frame.f_code
    return {"function": getattr(code, "co_qualname", code.co_name), "where": f"{code.co_filename}:{frame.f_lineno}"}
