"""Launch templates: ``{port}`` and ``{knob_name}`` placeholders.

Templates use Python's ``str.format`` brace syntax restricted to bare names: no
attribute access, indexing or format specs, so a template cannot reach into Python
objects.  A literal brace is written ``{{`` / ``}}`` (e.g. ``$${{HOME}}`` in a shell
string).
"""

from __future__ import annotations

import string
from collections.abc import Mapping

_FORMATTER = string.Formatter()


def placeholders(template: str) -> list[str]:
    """Names used in ``template``, in order; ``ValueError`` on malformed braces."""
    names: list[str] = []
    for _, field, spec, conversion in _FORMATTER.parse(template):
        if field is None:
            continue
        if not field.isidentifier() or spec or conversion:
            raise ValueError(f"placeholder {{{field}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}} is not a bare name")
        names.append(field)
    return names


def render(template: str, values: Mapping[str, str]) -> str:
    """Substitute every placeholder; all names must be in ``values`` (checked by callers)."""
    out: list[str] = []
    for literal, field, _, _ in _FORMATTER.parse(template):
        out.append(literal)
        if field is not None:
            out.append(values[field])
    return "".join(out)
