"""Load kernel specs from a Python file by path.

Each load executes the file as a fresh, anonymous module and collects the
``KernelSpec`` objects from its namespace, so two loads share no state and nothing
stays in ``sys.modules``.  Every way a spec can be broken -- the file fails to
import, a spec declares no reference, the input factory throws on a declared shape --
becomes a ``KernelSpecError`` naming the file, the spec and the part at fault (input
factory, reference, variant).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import sys
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from infra_agent.errors import KernelSpecError
from infra_agent.lab.spec import (
    CALLABLE_FIELDS,
    KERNEL,
    KernelSpec,
    Shape,
    SpecSource,
    shape_label,
)

_counter = itertools.count()


def spec_error(spec: KernelSpec | str, part: str | None, problem: str, origin: str | None = None) -> KernelSpecError:
    """A ``KernelSpecError`` whose message starts with file, spec and the part at fault.

    ``part`` is said as what it is -- ``"input factory"``, ``"reference"``,
    ``variant_part(name)`` -- because the reader goes looking for it in the spec file.
    """
    name = spec.name if isinstance(spec, KernelSpec) else spec
    where = origin if origin is not None else (spec.origin if isinstance(spec, KernelSpec) else "")
    head = f"{where or '<spec>'}: spec '{name}'"
    if part:
        head += f", {part}"
    return KernelSpecError(f"{head}: {problem}")


def variant_part(name: str) -> str:
    return f"variant '{name}'"


def _exec_file(path: Path) -> ModuleType:
    module_name = f"_infra_agent_kernel_spec_{next(_counter)}"
    importer = importlib.util.spec_from_file_location(module_name, path)
    if importer is None or importer.loader is None:
        raise KernelSpecError(f"{path}: not a loadable Python file")
    module = importlib.util.module_from_spec(importer)
    # dataclasses and typing resolve names through sys.modules while the file runs,
    # and a spec file may import helpers that sit next to it; both are undone after.
    # The spec's folder goes LAST on sys.path: a helper there is found, but a module
    # there can never stand in for an installed one (a ``refstack/`` or ``torch.py``
    # beside the spec would otherwise replace the reference it is checked against).
    sys.modules[module_name] = module
    added = str(path.parent) not in sys.path
    if added:
        sys.path.append(str(path.parent))
    try:
        importer.loader.exec_module(module)
    except KernelSpecError as exc:
        raise KernelSpecError(f"{path}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any failure of user code is a spec error
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
        line = f" (line {frames[-1].lineno})" if frames else ""
        raise KernelSpecError(f"{path}{line}: spec file failed to import: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.modules.pop(module_name, None)
        if added and str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
    return module


def _collect(module: ModuleType, path: Path) -> list[KernelSpec]:
    found: list[KernelSpec] = []

    def take(obj: Any) -> None:
        if isinstance(obj, KernelSpec):
            found.append(obj)
        elif isinstance(obj, (list, tuple)) and obj and all(isinstance(o, KernelSpec) for o in obj):
            found.extend(obj)

    factory = getattr(module, "specs", None)
    if callable(factory):
        try:
            produced = factory()
        except Exception as exc:  # noqa: BLE001
            raise KernelSpecError(f"{path}: specs() raised {type(exc).__name__}: {exc}") from exc
        take(produced if not isinstance(produced, Iterable) or isinstance(produced, KernelSpec) else list(produced))
    for name, obj in vars(module).items():
        if not name.startswith("_"):
            take(obj)
    # The same object may be reachable under two names (SPEC and SPECS = [SPEC]).
    unique: list[KernelSpec] = []
    for s in found:
        if not any(s is u for u in unique):
            unique.append(s)
    return unique


def _check_inputs(spec: KernelSpec, shape: Shape, dtype: torch.dtype) -> None:
    try:
        produced = spec.inputs(shape, dtype, 0, "cpu")
    except Exception as exc:  # noqa: BLE001
        raise spec_error(
            spec, "input factory", f"raised {type(exc).__name__}: {exc} for shape [{shape_label(shape)}] dtype={dtype}"
        ) from exc
    if not isinstance(produced, dict) or not produced:
        raise spec_error(spec, "input factory", f"must return a non-empty dict of tensors, got {type(produced).__name__}")
    for v in spec.variants:
        try:
            v.supports(shape)
        except Exception as exc:  # noqa: BLE001
            raise spec_error(spec, variant_part(v.name), f"applies() raised {type(exc).__name__}: {exc} for shape [{shape_label(shape)}]") from exc


def validate(spec: KernelSpec, check_inputs: bool = True) -> None:
    problems = spec.problems()
    if problems:
        where, what = problems[0]
        variant = where if any(v.name == where for v in spec.variants) else None
        field = "" if variant else f"{where}: "
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise spec_error(spec, variant_part(variant) if variant else None, f"{field}{what}{more}")
    if check_inputs:
        # One cheap call per declared check shape catches a broken factory before any
        # kernel runs, so a failure is blamed on the spec rather than the kernel.
        for shape in spec.shapes:
            _check_inputs(spec, shape, spec.dtypes[0])


def load_specs(path: str | Path, check_inputs: bool = True) -> list[KernelSpec]:
    """All specs declared in the file at ``path``, validated, with ``origin`` set."""
    p = Path(path).resolve()
    if not p.is_file():
        raise KernelSpecError(f"{path}: no such spec file")
    digest = hashlib.sha256(p.read_bytes()).hexdigest()
    module = _exec_file(p)
    specs = [
        dataclasses.replace(
            s, origin=str(p),
            source=SpecSource(str(p), s.name, digest, {f: getattr(s, f) for f in CALLABLE_FIELDS}, tuple(s.variants)),
        )
        for s in _collect(module, p)
    ]
    if not specs:
        raise KernelSpecError(f"{p}: defines no KernelSpec (expected a module-level KernelSpec, a list of them, or specs())")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise KernelSpecError(f"{p}: spec name(s) {dupes} declared more than once")
    for s in specs:
        validate(s, check_inputs=check_inputs)
    return specs


def select(specs: list[KernelSpec], name: str | None) -> list[KernelSpec]:
    """The spec called ``name``, or all of them when ``name`` is None."""
    if name is None:
        return specs
    chosen = [s for s in specs if s.name == name]
    if not chosen:
        origin = specs[0].origin if specs else "<spec>"
        raise KernelSpecError(f"{origin}: no spec named '{name}' (have {[s.name for s in specs]})")
    return chosen


def known_variants(spec: KernelSpec) -> list[str]:
    # "kernel" selects no partition: the unpartitioned kernel is always checked.
    return [KERNEL] + [v.name for v in spec.variants]


def require_declared(spec: KernelSpec, precisions: Sequence[str] | None, variants: Sequence[str] | None) -> None:
    """Raise ``KernelSpecError`` for a precision or variant name ``spec`` does not declare.

    A typo (``--precision fp46``) must be a user error, not a run that silently checks
    nothing and reports success.
    """
    for p in precisions or ():
        if p not in spec.precisions:
            raise spec_error(spec, None, f"unknown precision '{p}' (declared: {list(spec.precisions)})")
    for name in variants or ():
        if name not in known_variants(spec):
            raise spec_error(spec, None, f"unknown variant '{name}' (declared: {known_variants(spec)})")


def narrow(
    specs: Sequence[KernelSpec], precisions: Sequence[str] | None, variants: Sequence[str] | None
) -> list[tuple[KernelSpec, list[str] | None, list[str] | None, list[str]]]:
    """Per spec of a file: the requested names it declares, and what it leaves out.

    A name that no selected spec declares is a typo and raises ``KernelSpecError``
    naming the spec(s) and the known names.  With several specs in one file, a name
    some of them declare is applied to those; the others note it as skipped, and a spec
    that declares none of the requested precisions is not run (the note says so).
    """
    for kind, wanted, known in (
        ("precision", precisions, lambda s: list(s.precisions)),
        ("variant", variants, known_variants),
    ):
        union = list(dict.fromkeys(n for s in specs for n in known(s)))
        for name in wanted or ():
            if name not in union:
                if len(specs) == 1:
                    require_declared(specs[0], precisions, variants)
                names = ", ".join(f"'{s.name}'" for s in specs)
                origin = specs[0].origin if specs else "<spec>"
                raise KernelSpecError(f"{origin}: specs {names}: unknown {kind} '{name}' (declared: {union})")
    out: list[tuple[KernelSpec, list[str] | None, list[str] | None, list[str]]] = []
    for s in specs:
        notes: list[str] = []
        ps = None if not precisions else [p for p in precisions if p in s.precisions]
        vs = None if variants is None else [v for v in variants if v in known_variants(s)]
        for p in [p for p in precisions or () if p not in s.precisions]:
            notes.append(f"precision {p} is not declared by spec '{s.name}' (declares {list(s.precisions)})")
        for v in [v for v in variants or () if v not in known_variants(s)]:
            notes.append(f"variant {v} is not declared by spec '{s.name}' (declares {known_variants(s)})")
        if ps == []:
            notes.append(f"spec '{s.name}' declares none of the requested precisions {list(precisions or ())}; not run")
        out.append((s, ps, vs, notes))
    return out
