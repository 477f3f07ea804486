"""Code tools: ``read_file``, ``search_code`` and ``propose_diff``.

Every path is confined to ``ctx.code_root`` with symlinks resolved
(:func:`infra_agent.safety.confine`); files of any size are read in bounded pieces.
``propose_diff`` only stores a diff as the pending change after ``git apply --check``
accepts it and it touches no protected path; the executor applies it (and checks
again) in its own worktree.
"""

from __future__ import annotations

import codecs
import fnmatch
import os
import re
import subprocess
import time
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from pydantic import Field

from infra_agent.errors import InfraAgentError
from infra_agent.safety import confine
from infra_agent.tools.registry import Tool, ToolArgs, ToolContext, ToolResult

# read_file
MAX_LINES = 2000
DEFAULT_LINES = 200
MAX_READ_CHARS = 10_000  # of file text in one result
MAX_LINE_CHARS = 1_000  # a longer line is cut (minified code, data files)
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS
_COUNT_LINES_MAX_BYTES = 256 * 2**20  # count a file's lines only below this size
_BINARY_SNIFF = 8192
# search_code
MAX_RESULTS = 500
SEARCH_MAX_FILE_BYTES = 2 * 2**20
SEARCH_MAX_FILES = 20_000
SEARCH_MAX_S = 10.0
SKIP_DIRS = frozenset({".git", ".infra-agent", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache",
                       ".pytest_cache", ".ruff_cache", ".tox", "build", "dist", ".eggs"})
GIT_TIMEOUT_S = 30.0


# ---------------------------------------------------------------- read_file


class ReadFileArgs(ToolArgs):
    path: str = Field(description="a file (or folder, to list it) relative to the code root")
    start_line: int = Field(1, ge=1, description="first line to show (1-based)")
    max_lines: int = Field(DEFAULT_LINES, ge=1, le=MAX_LINES, description="most lines to show")


def read_file(ctx: ToolContext, args: ReadFileArgs) -> ToolResult:
    full = confine(ctx.code_root, args.path)
    if not full.exists():
        return ToolResult.fail(f"read_file: no such file {args.path!r} under the code root", path=args.path)
    if full.is_dir():
        return _list_dir(ctx, full, args.path)
    size = full.stat().st_size
    lines: list[str] = []
    shortened = 0
    shown_end = 0  # file offset after the last line shown
    with full.open("rb") as f:
        if b"\0" in f.read(_BINARY_SNIFF):
            return ToolResult(text=f"{args.path}: a binary file of {size} bytes; not shown",
                              data={"path": args.path, "bytes": size, "binary": True})
        f.seek(0)
        chars = 0
        lineno = 0
        while (line := _read_line(f)) is not None:
            raw, long = line
            lineno += 1
            if lineno < args.start_line:
                continue
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if long or len(text) > MAX_LINE_CHARS:
                text = text[:MAX_LINE_CHARS] + " [... line cut]"
                shortened += 1
            if len(lines) >= args.max_lines or chars + len(text) > MAX_READ_CHARS:
                break
            lines.append(f"{lineno:>6}  {text}")
            chars += len(text) + 1
            shown_end = f.tell()
    last = args.start_line + len(lines) - 1
    rest_bytes = size - shown_end if lines else 0
    total = _count_lines(full, size)
    header = f"{args.path}: lines {args.start_line}-{last}" if lines else f"{args.path}: no lines from {args.start_line}"
    header += f" of {total}" if total is not None else f" ({size} bytes)"
    body = "\n".join(lines)
    footer = ""
    if rest_bytes > 0 and lines:
        more = f"{total - last} more lines, " if total is not None else ""
        footer = f"\n[... {more}{rest_bytes} bytes cut; read on with start_line={last + 1}]"
    if shortened:
        footer += f"\n[{shortened} lines longer than {MAX_LINE_CHARS} characters were shortened]"
    return ToolResult(text=f"{header}\n{body}{footer}",
                      data={"path": args.path, "start_line": args.start_line, "end_line": last, "total_lines": total,
                            "bytes": size, "cut_bytes": rest_bytes})


def _read_line(f: BinaryIO) -> tuple[bytes, bool] | None:
    """One line, at most ``MAX_LINE_BYTES`` of it; the rest of a longer line is skipped.  (line, cut)."""
    raw = f.readline(MAX_LINE_BYTES)
    if not raw:
        return None
    if raw.endswith(b"\n") or len(raw) < MAX_LINE_BYTES:
        return raw, False
    while chunk := f.readline(1 << 20):
        if chunk.endswith(b"\n"):
            break
    return raw, True


def _count_lines(path: Path, size: int) -> int | None:
    if size > _COUNT_LINES_MAX_BYTES:
        return None
    n = 0
    last = b"\n"
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (0 if last == b"\n" else 1)


def _list_dir(ctx: ToolContext, full: Path, shown: str) -> ToolResult:
    entries = []
    for child in sorted(full.iterdir(), key=lambda p: p.name):
        if child.name in SKIP_DIRS:
            continue
        try:
            # A link out of the tree is listed as such, never followed.
            confine(ctx.code_root, child.relative_to(Path(ctx.code_root).resolve()))
            kind = "/" if child.is_dir() else ""
        except InfraAgentError:
            kind = " -> (outside the code root)"
        entries.append(child.name + kind)
    text = f"{shown}: a folder of {len(entries)} entries\n" + "\n".join(entries[:500])
    if len(entries) > 500:
        text += f"\n[... {len(entries) - 500} more entries cut]"
    return ToolResult(text=text, data={"path": shown, "entries": entries[:500]})


# ---------------------------------------------------------------- search_code


class SearchCodeArgs(ToolArgs):
    pattern: str = Field(min_length=1, description="a Python regular expression, matched per line")
    glob: str | None = Field(None, description="only files whose path or name matches, e.g. '*.py' or 'src/engine/*'")
    max_results: int = Field(50, ge=1, le=MAX_RESULTS, description="most matching lines to return")


def search_code(ctx: ToolContext, args: SearchCodeArgs) -> ToolResult:
    try:
        rx = re.compile(args.pattern)
    except re.error as exc:
        return ToolResult.fail(f"search_code: field 'pattern': expected a Python regular expression, "
                               f"got {args.pattern!r} ({exc})", pattern=args.pattern)
    root = Path(ctx.code_root).resolve()
    matches: list[dict[str, object]] = []
    files_with = set()
    scanned = skipped_big = 0
    stopped = ""
    t0 = time.monotonic()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if args.glob and not (fnmatch.fnmatch(rel, args.glob) or fnmatch.fnmatch(name, args.glob)):
                continue
            if path.is_symlink():
                try:
                    confine(root, rel)
                except InfraAgentError:
                    continue  # never read through a link out of the tree
            try:
                if not path.is_file():
                    continue
                if path.stat().st_size > SEARCH_MAX_FILE_BYTES:
                    skipped_big += 1
                    continue
                data = path.read_bytes()
            except OSError:
                continue
            if b"\0" in data[:_BINARY_SNIFF]:
                continue
            scanned += 1
            for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                if rx.search(line[:MAX_LINE_CHARS]):
                    files_with.add(rel)
                    matches.append({"file": rel, "line": i, "text": line[:300]})
                    if len(matches) >= args.max_results:
                        stopped = f"stopped at max_results={args.max_results}"
                        break
            if stopped:
                break
            if scanned >= SEARCH_MAX_FILES:
                stopped = f"stopped after {SEARCH_MAX_FILES} files"
            elif time.monotonic() - t0 > SEARCH_MAX_S:
                stopped = f"stopped after {SEARCH_MAX_S:.0f} s"
            if stopped:
                break
        if stopped:
            break
    head = f"{len(matches)} matching lines in {len(files_with)} files ({scanned} files searched"
    head += f", {skipped_big} files over {SEARCH_MAX_FILE_BYTES // 2**20} MB skipped" if skipped_big else ""
    head += f"; {stopped})" if stopped else ")"
    body = "\n".join(f"{m['file']}:{m['line']}: {m['text']}" for m in matches)
    return ToolResult(text=head + ("\n" + body if body else ""),
                      data={"matches": matches, "files_searched": scanned, "stopped": stopped or None})


# ---------------------------------------------------------------- propose_diff


class ProposeDiffArgs(ToolArgs):
    diff: str = Field(description="a unified diff in git format (paths prefixed a/ and b/, relative to the code root); "
                                  "an empty string clears the pending diff")


_DIFF_GIT = re.compile(r'^diff --git ("(?:[^"\\]|\\.)*"|\S+) ("(?:[^"\\]|\\.)*"|\S+)\s*$')
_HEADER = re.compile(r"^(---|\+\+\+) (.*)$")
_META = re.compile(r"^(rename from|rename to|copy from|copy to) (.*)$")


def diff_paths(diff: str) -> list[str]:
    """Every path a git-format diff names (old and new sides, renames and copies), prefixes stripped.

    Raises ``InfraAgentError`` for a header path without the ``a/``/``b/`` prefix.
    """
    paths: list[str] = []

    def add(p: str) -> None:
        if p not in paths:
            paths.append(p)

    for line in diff.splitlines():
        m = _DIFF_GIT.match(line)
        if m:
            for side, prefix in ((m.group(1), "a/"), (m.group(2), "b/")):
                add(_strip_prefix(_unquote(side), prefix, line))
            continue
        m = _HEADER.match(line)
        if m:
            raw = _unquote(m.group(2).split("\t", 1)[0].rstrip())
            if raw != "/dev/null":
                add(_strip_prefix(raw, "a/" if m.group(1) == "---" else "b/", line))
            continue
        m = _META.match(line)
        if m:
            add(_unquote(m.group(2).rstrip()))
    return paths


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        # git quotes odd names C-style, with octal escapes for bytes.
        return codecs.escape_decode(text[1:-1].encode())[0].decode("utf-8", errors="replace")  # type: ignore[attr-defined,no-any-return]
    return text


def _strip_prefix(path: str, prefix: str, line: str) -> str:
    if not path.startswith(prefix):
        raise InfraAgentError(f"expected header paths with the {prefix} prefix of git diffs "
                              f"(e.g. '--- a/src/x.py' and '+++ b/src/x.py'), got {line!r}")
    return path[len(prefix):]


def protected_match(path: str, patterns: list[str]) -> str | None:
    """The first pattern that protects ``path`` (fnmatch; a folder pattern covers what is under it)."""
    for pat in patterns:
        pat = pat.strip()
        if not pat:
            continue
        folder = pat.rstrip("/")
        if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, folder + "/*") or PurePosixPath(path).match(pat):
            return pat
    return None


def propose_diff(ctx: ToolContext, args: ProposeDiffArgs) -> ToolResult:
    if not args.diff.strip():
        had = bool(ctx.pending.diff)
        ctx.pending = ctx.pending.model_copy(update={"diff": None})
        return ToolResult(text="pending diff cleared" if had else "no pending diff to clear", data={"cleared": had})
    diff = args.diff if args.diff.endswith("\n") else args.diff + "\n"
    paths = diff_paths(diff)
    if not paths:
        return ToolResult.fail("propose_diff: expected a unified diff with file headers ('--- a/PATH', '+++ b/PATH'), "
                               f"got no file headers in {len(diff)} characters")
    for p in paths:
        parts = PurePosixPath(p).parts
        if p.startswith("/") or ".." in parts:
            return ToolResult.fail(f"propose_diff: path {p!r} leaves the code root; give paths relative to it", path=p)
        if parts and parts[0] == ".git":
            return ToolResult.fail(f"propose_diff: path {p!r} is inside git's own folder; a diff may not touch it", path=p)
        confine(ctx.code_root, p)
        pat = protected_match(p, ctx.protected)
        if pat is not None:
            return ToolResult.fail(f"propose_diff: path {p!r} is protected (pattern {pat!r}); "
                                   "change other files", path=p, pattern=pat)
    ok, message = git_apply_check(ctx.code_root, diff)
    if not ok:
        return ToolResult.fail(f"propose_diff: the diff does not apply to the current code (git apply --check):\n{message}",
                               paths=paths, git=message)
    added = sum(1 for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
    removed = sum(1 for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---"))
    replaced = bool(ctx.pending.diff)
    ctx.pending = ctx.pending.model_copy(update={"diff": diff})
    text = (f"the diff applies cleanly: {len(paths)} path(s) ({', '.join(paths)}), +{added} -{removed} lines; "
            f"{'it replaces the previous pending diff; ' if replaced else ''}"
            "it is pending until run_experiment")
    return ToolResult(text=text, data={"paths": paths, "added": added, "removed": removed, "replaced": replaced})


def git_apply_check(code_root: Path, diff: str) -> tuple[bool, str]:
    """``git apply --check`` of ``diff`` in ``code_root``; (ok, git's message)."""
    root = Path(code_root).resolve()
    env = dict(os.environ)
    # Keep git from finding a repository above the code root: paths are relative to it.
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    env["LC_ALL"] = "C"
    try:
        proc = subprocess.run(["git", "apply", "--check", "--verbose", "-"], check=False, input=diff.encode(), cwd=root,
                              capture_output=True, timeout=GIT_TIMEOUT_S, env=env)
    except FileNotFoundError:
        raise InfraAgentError("cannot check the diff: the `git` command was not found on PATH") from None
    except subprocess.TimeoutExpired:
        return False, f"git apply --check did not finish within {GIT_TIMEOUT_S:.0f} s"
    out = (proc.stderr or b"").decode(errors="replace").strip()
    if proc.returncode != 0:
        return False, out or f"git apply exited with {proc.returncode}"
    return True, out


TOOLS = [
    Tool("read_file", "Read lines of a file under the code root (a folder path lists the folder). Output is bounded; "
                      "page with start_line.", ReadFileArgs, read_file),
    Tool("search_code", "Search the code root's files line by line with a regular expression; returns file:line: text.",
         SearchCodeArgs, search_code),
    Tool("propose_diff", "Set the pending code change: a unified diff in git format against the current code. It is "
                         "checked with git apply --check and kept until run_experiment.", ProposeDiffArgs, propose_diff),
]
