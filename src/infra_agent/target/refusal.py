"""The engine's own error line, found in the log of a server that exited before it was ready.

An engine that refuses its arguments (vLLM: ``max_num_batched_tokens`` below ``max_num_seqs``)
prints a traceback of some forty lines and exits; the one line that says why is the
exception at its end, often followed by warnings about leaked semaphores or an unclosed
process group.  :func:`engine_reason` picks that line, so an error message, a finding and a
screening message can quote it instead of "exited with code 1".

What counts, strongest first:

1. the exception that ends a Python traceback (the last one in the tail); a chained one
   that only points "above" (``Engine core initialization failed. See root cause above``)
   gives way to the exception before it.  A pydantic ``ValidationError`` keeps its error
   lines (``Value error, ...``), since its first line only counts them; an exception without
   a message keeps the source line that raised it (a bare ``assert``);
2. a command-line parser's refusal: argparse's ``prog: error: argument --x: invalid int
   value: 'y'``, click's ``Error: Invalid value for '--x'``;
3. else the last log record at level ERROR, CRITICAL or FATAL.

Warnings, INFO lines, ``Traceback (most recent call last):`` and the frames are never the
reason.  Prefixes that servers put before every line (vLLM's ``(APIServer pid=12)``, torch's
``[rank0]:``, SGLang's ``[2025-01-02 10:00:00 TP0]``) are stripped first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A reason is one line in a message: a longer one is cut here.
MAX_REASON = 400

_PREFIXES = (
    re.compile(r"^\([\w.\-]+(?: \w+)* pid=\d+\)\s?"),  # (APIServer pid=123), (EngineCore_DP0 pid=9)
    re.compile(r"^\[rank\d+\]:\s?"),  # torch.distributed
    re.compile(r"^\[\d{4}-\d\d-\d\d[ T][\d:.,]+(?: [^\]]*)?\]\s?"),  # [2025-01-02 10:00:00 TP0]
)
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")
_FRAME = re.compile(r'^\s+File "(?:[^"]*/)?([^"/]*)", line (\d+)')  # the file's name, the line
_CHAIN = re.compile(r"^(The above exception was the direct cause|During handling of the above exception)")
# An exception line: a (dotted) class name, then its message after ": ", or nothing.
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
_ARGPARSE = re.compile(r"^(?:\S[^:]*: )?error: \S")
_CLICK = re.compile(r"^Error: \S")
_LOG_ERROR = re.compile(r"^(?:\S+ )?(?:ERROR|CRITICAL|FATAL)\b[:\s]")
_LOG_LEVEL = re.compile(r"^(?:\S+ )?(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\b[:\s]")
_POINTS_ABOVE = re.compile(r"\babove\b", re.IGNORECASE)
_PYDANTIC_TAIL = re.compile(r"\s*\[type=.*\]\s*$")
_PYDANTIC_LINK = re.compile(r"^\s*For further information visit ")


@dataclass(frozen=True)
class _Raised:
    """One exception at the end of a traceback: its line, and the frame that raised it."""

    line: str
    frame: str  # ``file.py:12: source line`` of the last frame, "" when the tail cut it off


def strip_prefix(line: str) -> str:
    """``line`` without the per-line prefixes a server's logger adds."""
    for pattern in _PREFIXES:
        line = pattern.sub("", line, count=1)
    return line.rstrip()


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"


def _continuation(lines: list[str], start: int, exc_name: str) -> list[str]:
    """The lines after an exception line that belong to its message (a pydantic error list)."""
    if not exc_name.endswith("ValidationError"):
        return []
    out: list[str] = []
    for line in lines[start:]:
        if not line.strip() or _TRACEBACK.match(line) or _CHAIN.match(line) or _LOG_LEVEL.match(line):
            break
        if _PYDANTIC_LINK.match(line):
            continue
        if not line[0].isspace() and not re.fullmatch(r"[\w.\[\]]+", line):
            break  # neither an indented error nor a field name: the log goes on
        out.append(_PYDANTIC_TAIL.sub("", line).strip())
    return out


def _raised(lines: list[str]) -> list[_Raised]:
    """Every exception that ends a traceback in ``lines``, in order."""
    found: list[_Raised] = []
    in_frames = False
    where = source = ""  # the last frame's ``file.py:12`` and its source line
    for i, line in enumerate(lines):
        if _TRACEBACK.match(line):
            in_frames, where, source = True, "", ""
            continue
        head = _FRAME.match(line)
        if head:
            # A tail cut inside a traceback starts with its frames: they open it as well.
            in_frames, source = True, ""
            where = f"{head.group(1)}:{head.group(2)}"
            continue
        if not in_frames or not line.strip():
            continue
        if line[0].isspace():
            text = line.strip()
            if where and not source and not set(text) <= set("^~ "):
                source = text  # the frame's source line; the carets under it are not
            continue
        if _LOG_LEVEL.match(line):
            continue  # another process's log record, printed between the frames
        in_frames = False
        exc = _EXCEPTION.match(line)
        if exc is None:
            continue
        extra = _continuation(lines, i + 1, exc.group(1))
        frame = f"{where}: {source}" if where and source else where
        found.append(_Raised(": ".join([line, *extra]) if extra else line, frame))
    return found


def _exception_reason(lines: list[str]) -> str | None:
    raised = _raised(lines)
    if not raised:
        return None
    # The last exception, unless it only points at one before it.
    pick = next((r for r in reversed(raised) if not _POINTS_ABOVE.search(r.line)), raised[-1])
    exc = _EXCEPTION.match(pick.line)
    if exc is not None and not exc.group(2) and pick.frame:
        return f"{pick.line} at {pick.frame}"  # a bare ``AssertionError``: the assert says why
    return pick.line


def engine_reason(log_tail: str) -> str | None:
    """The engine's own error line in a server's ``log_tail``, or None when there is none."""
    lines = [strip_prefix(line) for line in log_tail.splitlines()]
    reason = _exception_reason(lines)
    if reason is None:
        usage = [line for line in lines if _ARGPARSE.match(line) or _CLICK.match(line)]
        reason = usage[-1] if usage else None
    if reason is None:
        logged = [line for line in lines if _LOG_ERROR.match(line) and not _TRACEBACK.search(line)]
        reason = logged[-1] if logged else None
    return _short(reason) if reason else None


__all__ = ["MAX_REASON", "engine_reason", "strip_prefix"]
