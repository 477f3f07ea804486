"""Knob domains from a server's ``--help``: ``vllm serve --help=all``, SGLang's launcher.

Both print argparse help, so one parser reads them: each option's flags, its metavar,
its ``{a,b,c}`` choices, whether it is an on/off pair (``--x, --no-x``), and the value
after ``(default: ...)``.  ``knob_spec`` turns one option into a workspace knob, so an
example's domains follow the installed server instead of a list typed from memory:

- listed choices give a ``choice`` knob;
- an on/off pair gives a ``choice`` between its two flags (``--x`` / ``--no-x``): such
  a flag takes no value, so the command template places the chosen flag itself;
- anything else gets the type the caller asks for.  Integer ranges are not in help
  text; the caller gives them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from infra_agent.errors import ConfigError

# An option line: two to six spaces, then the flags ("--a A, --b A" or "--x, --no-x").
_OPTION = re.compile(r"^ {2,6}(-{1,2}[A-Za-z0-9][^ ]*(?:[ ,].*)?)$")
_CHOICES = re.compile(r"^\{([^{}]*)\}$")
_DEFAULT = re.compile(r"\(default: (.*?)\)\s*$", re.DOTALL)


@dataclass
class HelpOption:
    flags: list[str]
    metavar: str | None = None
    choices: list[str] | None = None
    default: str | None = None  # as printed; "None" when argparse printed None
    text: str = ""
    negatable: bool = False  # "--x, --no-x": an on/off pair
    lines: list[str] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        """The knob name: the long flag without dashes, '-' as '_' (``max_num_seqs``)."""
        long = next((f for f in self.flags if f.startswith("--") and not f.startswith("--no-")), self.flags[0])
        return long.lstrip("-").replace("-", "_")


def _head(spec: str) -> tuple[list[str], str | None, str]:
    """Flags and metavar of an option line; the rest is help text on the same line."""
    parts = re.split(r" {2,}", spec, maxsplit=1)
    flags_part, rest = parts[0], parts[1] if len(parts) > 1 else ""
    flags: list[str] = []
    metavar: str | None = None
    for piece in flags_part.split(", "):
        words = piece.split(" ", 1)
        flags.append(words[0])
        if len(words) > 1:
            metavar = words[1].strip()
    return flags, metavar, rest.strip()


def parse_help(text: str) -> dict[str, HelpOption]:
    """Every ``--option`` of an argparse help text, by knob name (first seen wins)."""
    options: dict[str, HelpOption] = {}
    current: HelpOption | None = None
    for raw in text.splitlines():
        m = _OPTION.match(raw)
        if m:
            flags, metavar, rest = _head(m.group(1))
            current = HelpOption(flags=flags, metavar=metavar)
            current.negatable = any(f.startswith("--no-") for f in flags)
            if metavar and (c := _CHOICES.match(metavar)):
                current.choices = [x.strip() for x in c.group(1).split(",") if x.strip()]
            if rest:
                current.lines.append(rest)
            if any(f.startswith("--") for f in flags):
                options.setdefault(current.name, current)
        elif current is not None and raw.startswith(" " * 8) and raw.strip():
            current.lines.append(raw.strip())
        elif not raw.strip() or not raw.startswith(" "):
            current = None  # a blank line or a group title ends the option
    for opt in options.values():
        opt.text = " ".join(opt.lines)
        d = _DEFAULT.search(opt.text)
        if d:
            opt.default = d.group(1).strip()
            opt.text = opt.text[: d.start()].strip()
    return options


def _parse_default(raw: str | None, kind: str) -> Any:
    if raw is None or raw == "None":
        return None
    try:
        if kind == "bool":
            return {"True": True, "False": False}[raw]
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except (KeyError, ValueError):
        return None
    return raw.strip("'\"")


def knob_spec(options: dict[str, HelpOption], name: str, kind: str = "int", *, source: str = "--help",
              **domain: Any) -> dict[str, Any]:
    """A workspace knob (``type``, ``choices`` or ``min``/``max``, ``default``) for option ``name``.

    The help decides ``choice`` (it lists choices, or is an on/off pair);
    otherwise ``kind`` is used with ``domain`` (``min``, ``max``, ``default``) from the
    caller.  A default the help prints wins over none given; ``domain`` wins over both.
    """
    opt = options.get(name)
    if opt is None:
        close = sorted(n for n in options if name.split("_")[-1] in n)[:5]
        raise ConfigError(source, name, "an option the server's help lists" + (f" (close: {', '.join(close)})" if close else ""),
                          "not in the help text")
    if opt.choices:
        spec: dict[str, Any] = {"type": "choice", "choices": list(opt.choices)}
        default = _parse_default(opt.default, "str")
        if default in opt.choices:
            spec["default"] = default
    elif opt.negatable:
        on = next(f for f in opt.flags if f.startswith("--") and not f.startswith("--no-"))
        off = next(f for f in opt.flags if f.startswith("--no-"))
        spec = {"type": "choice", "choices": [on, off]}
        default = _parse_default(opt.default, "bool")
        if default is not None:
            spec["default"] = on if default else off
    else:
        spec = {"type": kind}
        default = _parse_default(opt.default, kind)
        if default is not None:
            spec["default"] = default
    spec.update(domain)
    if opt.text:
        spec["help"] = opt.text.split(". ")[0].rstrip(".")[:120] + "."
    return spec
