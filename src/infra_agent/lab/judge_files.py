"""The files of a tree that the judge's side of a spec runs: its import graph, not a name list.

A kernel check's verdict rests on the spec's input factory, its reference and its
output dtypes.  When one of them calls into a module beside the spec (a helper that
builds the reference), a candidate that edits that module edits the judge.  The lab
already runs those from the pristine tree, so such an edit changes nothing it measures;
the executor refuses it before it runs, so the model learns at once that it is off
limits (``agent/executors/protect.py``).

The graph is walked from the functions themselves: the names their code (and nested
code) loads, looked up in their globals and closures; modules, classes and functions
defined in files under ``root`` are followed, anything outside (torch, the lab) is not.
The kernel and its variants are not starting points: the candidate may change them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from infra_agent.lab.spec import KernelSpec

# The callables a verdict depends on; ``kernel``, variants and ``outputs`` run on the candidate's side.
JUDGE_FIELDS = ("inputs", "reference", "out_dtypes")


def _names(code: CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            out |= _names(const)
    return out


def _file_of(obj: Any) -> Path | None:
    try:
        path = inspect.getsourcefile(obj) if not isinstance(obj, ModuleType) else getattr(obj, "__file__", None)
    except TypeError:
        return None
    return Path(path).resolve() if path else None


def _inside(path: Path | None, root: Path) -> bool:
    return path is not None and (path == root or root in path.parents)


def reachable_files(starts: Iterable[Any], root: Path) -> set[Path]:
    """Files under ``root`` holding code reachable from ``starts``."""
    root = root.resolve()
    files: set[Path] = set()
    seen: set[int] = set()
    stack = [s for s in starts if s is not None]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            stack += [obj.func, *obj.args, *obj.keywords.values()]
            continue
        where = _file_of(obj) if isinstance(obj, (ModuleType, type)) or inspect.isfunction(obj) or inspect.ismethod(obj) else None
        if not _inside(where, root):
            continue
        assert where is not None
        files.add(where)
        if isinstance(obj, ModuleType):
            continue  # its attributes are followed where code names them
        if isinstance(obj, type):
            stack += [v for v in vars(obj).values() if inspect.isfunction(v)]
            continue
        fn = obj.__func__ if inspect.ismethod(obj) else obj
        names = _names(fn.__code__)
        scope = fn.__globals__
        stack += [c.cell_contents for c in fn.__closure__ or () if _has_contents(c)]
        modules = _tree_modules(scope, names, root)
        for name in names:
            if name in scope:
                stack.append(scope[name])
            # ``helper.ref(...)``: the attribute of a module of the tree the code names.
            stack += [getattr(m, name) for m in modules if hasattr(m, name)]
    return files


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _tree_modules(scope: dict[str, Any], names: set[str], root: Path) -> list[ModuleType]:
    return [v for n, v in scope.items() if n in names and isinstance(v, ModuleType) and _inside(_file_of(v), root)]


def judge_files(specs: Iterable[KernelSpec], root: Path) -> list[str]:
    """Posix paths, relative to ``root``, of the files the specs' judging side runs
    (the spec files themselves included)."""
    root = root.resolve()
    starts: list[Any] = []
    found: set[Path] = set()
    for spec in specs:
        starts += [getattr(spec, f) for f in JUDGE_FIELDS]
        if spec.origin and _inside(Path(spec.origin).resolve(), root):
            found.add(Path(spec.origin).resolve())
    found |= reachable_files(starts, root)
    return sorted(p.relative_to(root).as_posix() for p in found)
