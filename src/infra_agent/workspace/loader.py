"""Load ``infra-agent.yaml`` into a :class:`Workspace`, with errors a person can act on.

This is the boundary where YAML and pydantic errors become ``ConfigError``: the
message names the file (with line:column where the YAML node is known), the field
path as written in the file (``scenarios.short.dataset.input_len``), what was
expected and what was found.  No pydantic text dump reaches the user.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from infra_agent.errors import ConfigError
from infra_agent.workspace.knobs import MISSING, DomainError
from infra_agent.workspace.models import Workspace

WORKSPACE_FILE = "infra-agent.yaml"

Loc = tuple[str | int, ...]


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def find_workspace_file(path: str | Path) -> Path:
    """``path`` may be the workspace folder or the YAML file itself."""
    p = Path(path)
    candidate = p / WORKSPACE_FILE if p.is_dir() else p
    if not candidate.is_file():
        raise ConfigError(str(candidate), None, f"a workspace folder holding {WORKSPACE_FILE}, or that file", "no such file")
    return candidate


def load_workspace(path: str | Path = ".") -> Workspace:
    """Load and validate a workspace; every problem raises ``ConfigError``.  The checks' probe
    configs are validated by the probes: :func:`infra_agent.probes.workspace_checks.load_workspace`."""
    file = find_workspace_file(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(file), None, "a readable UTF-8 file", str(exc)) from None
    return parse_workspace(text, file)


def parse_workspace(text: str, file: Path) -> Workspace:
    """Validate YAML ``text`` as if read from ``file`` (relative paths resolve against its folder)."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        raise ConfigError(where, None, "valid YAML", problem) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(file), None, "valid YAML", str(exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(str(file), None, "a mapping with keys target, knobs, scenarios, criteria", data)

    root = file.parent.resolve()
    try:
        workspace = Workspace.model_validate(data, context={"root": root})
    except ValidationError as exc:
        raise _translate(exc, file, text) from None
    workspace.bind(root, file.resolve())
    return workspace


# ---------------------------------------------------------------- error translation


def translate_validation_error(exc: ValidationError, file: str | Path, text: str = "", *,
                               root: type[BaseModel] = Workspace, prefix: Loc = ()) -> ConfigError:
    """A pydantic error on any model as one ``ConfigError`` (file, field, expected, got).

    ``root`` is the model that was validated; ``prefix`` is where its data sits in the
    file (``steps.2.config`` for a probe config inside a YAML step).  ``text``, when
    given, is the file's YAML, for ``file:line:col``.
    """
    return _translate(exc, Path(file), text, root, prefix)


def _translate(exc: ValidationError, file: Path, text: str, root: type[BaseModel] = Workspace, prefix: Loc = ()) -> ConfigError:
    problems: list[ConfigError] = []
    for err in exc.errors(include_url=False):
        problem = _one(err, file, text, root, prefix)
        same = next((p for p in problems if p.field == problem.field), None)
        if same is None:
            problems.append(problem)
        elif problem.expected not in same.expected:
            # the members of a plain union fail separately at one path: merge them
            merged = ConfigError(str(problem.file), problem.field, f"{same.expected} or {problem.expected}", same.got)
            problems[problems.index(same)] = merged
    first = problems[0]
    if len(problems) > 1:
        more = "; ".join(p.field or "<top>" for p in problems[1:6])
        first.args = (f"{first}\n(also {len(problems) - 1} more problem(s) at: {more})",)
    return first


def _one(err: Any, file: Path, text: str, root: type[BaseModel] = Workspace, prefix: Loc = ()) -> ConfigError:
    loc: Loc = tuple(err["loc"])
    kind: str = err["type"]
    cause = (err.get("ctx") or {}).get("error")
    path, model = _display_path(loc, root)
    path = prefix + path
    got: object = err.get("input")
    if isinstance(cause, DomainError):
        path = path + cause.subpath
        expected, got = cause.expected, cause.got
    elif kind == "extra_forbidden":
        allowed = sorted(model.model_fields) if model is not None else []
        expected = f"one of the keys {', '.join(allowed)}" if allowed else "no such key"
        got = path[-1]
    elif kind == "missing":
        expected, got = "a value (required)", MISSING
    elif kind == "union_tag_invalid":
        ctx = err["ctx"]
        path = path + (ctx["discriminator"].strip("'"),)
        expected = f"one of {ctx['expected_tags']}"
        got = ctx["tag"]
    elif kind == "union_tag_not_found":
        disc = err["ctx"]["discriminator"].strip("'")
        path = path + (disc,)
        expected, got = f"a `{disc}` key", MISSING
    else:
        expected = expected_text(err)
    field = ".".join(str(p) for p in path) or None
    if path[:1] == ("target",):
        got = _shown(path, got)
    return ConfigError(node_location(file, text, path) if text else str(file), field, expected, got)


def _shown(path: Loc, got: object) -> object:
    """What came under ``target``, as an error shows it: a ``target.env`` (or ``headers``) value
    whose name looks secret is ``***``, and so are URL passwords and secret flags' values anywhere."""
    from infra_agent.safety import MASK, scrub, secret_name

    if got is MISSING:
        return got
    named = len(path) >= 2 and path[1] in ("env", "headers")
    if named and len(path) >= 3 and secret_name(str(path[2])):
        return MASK
    if named and len(path) == 2 and isinstance(got, dict):
        got = {k: MASK if isinstance(k, str) and secret_name(k) else v for k, v in got.items()}
    return scrub(got)


# Bounds as pydantic reports them (``ctx`` key, words); pydantic's own text lacks the noun.
_BOUNDS = {"greater_than": ("gt", "greater than"), "greater_than_equal": ("ge", "greater than or equal to"),
           "less_than": ("lt", "less than"), "less_than_equal": ("le", "less than or equal to")}
_LENGTHS = {"too_short": ("min_length", "at least"), "too_long": ("max_length", "at most"),
            "string_too_short": ("min_length", "at least"), "string_too_long": ("max_length", "at most")}
# Pydantic's sentences open with these; what follows is what was expected.
_NOISE = ("Input should be ", "Value error, ", "Assertion failed, ")
# ... and some end with what came ("got a number with a fractional part") or how parsing
# failed ("unable to parse string as an integer"): the message says what came itself.
_TAIL = re.compile(r", (?:got|unable to|not) .*$")


def expected_text(err: Any) -> str:
    """What a pydantic error says was expected, as the words after "expected" in our messages.

    ``greater than 0`` becomes ``a number greater than 0``; ``String should have at least
    1 character`` becomes ``text of at least 1 character``; ``Input should be``, ``Value
    error,`` and a trailing ``got ...`` (the message names what came once, at its end)
    are dropped, also from a validator's own ``expected X, got Y``.
    """
    kind: str = err.get("type", "")
    ctx: dict[str, Any] = err.get("ctx") or {}
    if kind in _BOUNDS and _BOUNDS[kind][0] in ctx:
        key, words = _BOUNDS[kind]
        bound = ctx[key]
        return f"a number {words} {bound:g}" if isinstance(bound, (int, float)) else f"a value {words} {bound}"
    if kind in _LENGTHS and _LENGTHS[kind][0] in ctx:
        key, words = _LENGTHS[kind]
        n = ctx[key]
        if kind.startswith("string"):
            return f"text of {words} {n} character{'s' if n != 1 else ''}"
        return f"a {str(ctx.get('field_type') or 'value').lower()} of {words} {n} item{'s' if n != 1 else ''}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "a mapping (key: value lines, or {key: value})"
    msg = str(err.get("msg", ""))
    for noise in _NOISE:
        msg = msg.removeprefix(noise)
    msg = msg.removeprefix("expected ")
    return _TAIL.sub("", msg) or msg


def _display_path(loc: Loc, root: type[BaseModel] = Workspace) -> tuple[Loc, type[BaseModel] | None]:
    """Drop the discriminator tags pydantic inserts into ``loc`` by walking the model types.

    Returns the path as written in the YAML and the model class that owns its last key
    (used to list the allowed keys for an unknown one).
    """
    tp: Any = root
    owner: type[BaseModel] | None = None
    out: list[str | int] = []
    for part in loc:
        tp = _strip(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            owner = tp
            out.append(part)
            field = tp.model_fields.get(str(part))
            tp = field.annotation if field is not None else None
            if field is not None and field.discriminator is not None:
                tp = ("tagged", tp)
            continue
        if isinstance(tp, tuple) and tp[0] == "tagged":
            # this loc element is the tag pydantic chose; pick that member
            tp = next((m for m in _members(tp[1]) if _tag_of(m) == part), None)
            continue
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (Union, types.UnionType):
            # a plain union: pydantic names the member it tried (`str`, `list[str]`)
            tp = None
            continue
        out.append(part)
        if origin in (dict, typing.Mapping) and len(args) == 2:
            tp = args[1]
        elif origin is list and args:
            tp = args[0]
        else:
            tp = None
    return tuple(out), owner


def _strip(tp: Any) -> Any:
    """Unwrap Annotated[...] and Optional[...] down to the interesting type."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if typing.get_origin(tp) in (Union, types.UnionType):
            non_none = [a for a in typing.get_args(tp) if a is not type(None)]
            models = [a for a in non_none if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(non_none) == 1:
                tp = non_none[0]
                continue
            if len(models) == 1:
                tp = models[0]
                continue
        return tp


def _members(tp: Any) -> list[Any]:
    tp = typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp
    return list(typing.get_args(tp))


def _tag_of(model: Any) -> object:
    field = model.model_fields["kind"]
    return typing.get_args(field.annotation)[0]


def node_location(file: Path, text: str, path: Loc) -> str:
    """``file:line:col`` of the deepest YAML node on ``path`` that exists."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return str(file)
    mark = node.start_mark if node is not None else None
    for part in path:
        child = None
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node.value == str(part):
                    # an unknown key is best pointed at by the key itself
                    child = value_node
                    mark = key_node.start_mark
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
            mark = child.start_mark
        if child is None:
            break
        node = child
    if mark is None:
        return str(file)
    return f"{file}:{mark.line + 1}:{mark.column + 1}"
