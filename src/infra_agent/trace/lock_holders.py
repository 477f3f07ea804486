"""Who holds the lock a thread waits for: the other threads' frames inside a ``with LOCK:`` block.

A thread parked on a lock says where it waits, not why: the cause is the code that holds
the lock meanwhile, across a section longer than it should be.  py-spy does not see
lock owners, but a stack shows the block each frame is in.  A frame stopped inside the
body of ``with self._lock:`` (a bare name or attribute as the context manager: a lock,
a condition, a semaphore; a call such as ``with open(...)`` or ``with torch.no_grad():``
is something else) holds that lock, so in the snapshots where one thread is parked on a
lock, the other threads' such frames are the candidate holders (the outermost of those on
the innermost block's lock: a re-entrant lock taken again deeper down is held from the
outer block on), and the one seen in most of them is named.

A frame waiting in a ``Condition.wait`` inside its ``with cond:`` block has released the
lock for the wait, and one stopped on the ``with`` line itself is still taking it: neither
holds it.  Locks taken with ``acquire()`` and ``release()`` leave no block to see.
"""

from __future__ import annotations

import ast
import linecache
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infra_agent.trace.code_sites import is_plumbing
from infra_agent.trace.model import Frame

# (file) -> the module's source, as the analysis reads it (linecache's, checked fresh once).
ReadSource = Callable[[str], str]


@dataclass(frozen=True)
class HeldLock:
    frame: Frame  # the holder's frame inside the block
    lock: str  # the context manager's expression, as written ("self._lock")
    with_line: int  # the line of the ``with`` statement


def _read_source(file: str) -> str:
    return "".join(linecache.getlines(file))


class LockBlocks:
    """The ``with NAME:`` blocks of each source file, parsed once per analysis."""

    def __init__(self, read_source: ReadSource | None = None) -> None:
        self._read = read_source or _read_source
        self._blocks: dict[str, list[tuple[int, int, int, str]]] = {}

    def _of(self, file: str) -> list[tuple[int, int, int, str]]:
        if file not in self._blocks:
            blocks: list[tuple[int, int, int, str]] = []
            try:
                tree = ast.parse(self._read(file) or "")
            except (SyntaxError, ValueError):
                tree = None
            for node in ast.walk(tree) if tree is not None else ():
                if not isinstance(node, ast.With) or not node.body:
                    continue
                for item in node.items:
                    if isinstance(item.context_expr, (ast.Name, ast.Attribute)):
                        blocks.append((node.body[0].lineno, node.end_lineno or node.lineno, node.lineno,
                                       ast.unparse(item.context_expr)))
            self._blocks[file] = blocks
        return self._blocks[file]

    def held(self, frames: Sequence[Frame]) -> HeldLock | None:
        """The frame of a stack (innermost last) that holds a lock: the innermost frame stopped
        inside a ``with NAME:`` body names the lock, and the outermost frame inside a block on
        the same name holds it longest (a re-entrant lock taken again deeper down)."""
        found: HeldLock | None = None
        for f in reversed(frames):
            if f.line is None or is_plumbing(f):  # the standard library's own locks are its plumbing
                continue
            inside = [b for b in self._of(f.file) if b[0] <= f.line <= b[1]]
            if found is not None:
                inside = [b for b in inside if b[3] == found.lock]
            if inside:
                _, _, with_line, lock = max(inside, key=lambda b: b[0])
                found = HeldLock(f, lock, with_line)
        return found
