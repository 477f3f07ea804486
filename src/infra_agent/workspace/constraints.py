"""Constraints between knobs: ``max_num_batched_tokens >= max_num_seqs``.

A workspace lists them under ``constraints:``; the search never proposes a configuration
that breaks one, and screening refuses such a step before anything launches (vLLM refuses
to start with a step budget below its sequence cap, and a refused launch costs minutes).

The grammar is tiny on purpose, and parsed here, never evaluated as Python::

    constraint := side OP side            OP: >= <= > < == !=
    side       := atom [ARITH number]     ARITH: * / + -
    atom       := knob name | number

so ``a * 2 <= b`` and ``max_num_batched_tokens >= max_num_seqs`` are constraints, and
``__import__('os')`` is a syntax error.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)|(?P<name>[A-Za-z_]\w*)"
                    r"|(?P<op>>=|<=|==|!=|>|<)|(?P<arith>[*/+-]))")
COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq, "!=": operator.ne}
_ARITH: dict[str, Callable[[float, float], float]] = {
    "*": operator.mul, "/": operator.truediv, "+": operator.add, "-": operator.sub}
_NEGATION = {">=": "<", "<=": ">", ">": "<=", "<": ">=", "==": "!=", "!=": "=="}
SYNTAX = "a constraint such as 'a >= b' or 'a * 2 <= b + 1' (a knob name or a number, optionally */+- a number, on each side of >=, <=, >, <, == or !=)"


class ConstraintSyntaxError(ValueError):
    """The text is not a constraint of the grammar above."""


@dataclass(frozen=True)
class Side:
    """One side of a constraint: a knob or a number, optionally combined with a number."""

    name: str | None
    number: float | None
    arith: str | None = None
    operand: float | None = None

    def value(self, values: Mapping[str, Any]) -> float | None:
        """The side's value under ``values`` (None when its knob has no numeric value there)."""
        if self.name is not None:
            raw = values.get(self.name)
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                return None
            x = float(raw)
        else:
            assert self.number is not None
            x = self.number
        if self.arith is not None:
            assert self.operand is not None
            x = _ARITH[self.arith](x, self.operand)
        return x

    def show(self, values: Mapping[str, Any] | None = None) -> str:
        """``max_num_seqs=256`` (with values), ``max_num_seqs`` or ``2`` (without)."""
        if self.name is not None:
            atom = f"{self.name}={values[self.name]}" if values is not None and self.name in values else self.name
        else:
            atom = _num(self.number)
        return atom if self.arith is None else f"{atom} {self.arith} {_num(self.operand)}"


@dataclass(frozen=True)
class Constraint:
    text: str
    left: Side
    op: str
    right: Side

    @property
    def knobs(self) -> tuple[str, ...]:
        return tuple(s.name for s in (self.left, self.right) if s.name is not None)

    def holds(self, values: Mapping[str, Any]) -> bool:
        """True unless ``values`` break it (a side without a value cannot break it)."""
        a, b = self.left.value(values), self.right.value(values)
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            return True
        return COMPARISONS[self.op](a, b)

    def broken(self, values: Mapping[str, Any]) -> str:
        """How ``values`` break it: ``max_num_batched_tokens=20 < max_num_seqs=256``."""
        return f"{self.left.show(values)} {_NEGATION[self.op]} {self.right.show(values)}"


def _num(x: float | None) -> str:
    assert x is not None
    return str(int(x)) if float(x).is_integer() else repr(x)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ConstraintSyntaxError(f"unexpected {text[pos:].strip()[:20]!r}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _side(tokens: list[tuple[str, str]]) -> Side:
    if not tokens:
        raise ConstraintSyntaxError("a side is empty")
    sign = 1.0
    if tokens[0] == ("arith", "-") and len(tokens) > 1 and tokens[1][0] == "num":
        sign, tokens = -1.0, tokens[1:]  # a negative number: "-1"
    kind, atom = tokens[0]
    if kind == "name":
        side = Side(name=atom, number=None)
    elif kind == "num":
        side = Side(name=None, number=sign * float(atom))
    else:
        raise ConstraintSyntaxError(f"expected a knob name or a number, got {atom!r}")
    rest = tokens[1:]
    if not rest:
        return side
    if len(rest) != 2 or rest[0][0] != "arith" or rest[1][0] != "num":
        raise ConstraintSyntaxError(f"after {atom!r}, expected */+- and a number, got {' '.join(t for _, t in rest)!r}")
    operand = float(rest[1][1])
    if rest[0][1] == "/" and operand == 0:
        raise ConstraintSyntaxError("a division by zero")
    return Side(side.name, side.number, rest[0][1], operand)


def parse_constraint(text: str) -> Constraint:
    """``text`` as a :class:`Constraint`; ``ConstraintSyntaxError`` when it is not one."""
    tokens = _tokens(text)
    ops = [i for i, (kind, _) in enumerate(tokens) if kind == "op"]
    if len(ops) != 1:
        raise ConstraintSyntaxError("exactly one comparison (>=, <=, >, <, ==, !=)")
    i = ops[0]
    return Constraint(text=text.strip(), left=_side(tokens[:i]), op=tokens[i][1], right=_side(tokens[i + 1:]))


__all__ = ["SYNTAX", "Constraint", "ConstraintSyntaxError", "Side", "parse_constraint"]
