"""read_file, search_code, propose_diff: confined paths, bounded output, diffs checked by git."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from infra_agent.tools import ToolContext, ToolRegistry
from infra_agent.tools.code import diff_paths


def call(registry: ToolRegistry, ctx: ToolContext, name: str, **args: object):
    return registry.call(name, json.dumps(args), ctx)


# ---------------------------------------------------------------- read_file


def test_read_file_numbers_lines_and_pages(registry: ToolRegistry, ctx: ToolContext) -> None:
    r = call(registry, ctx, "read_file", path="src/engine.py")
    assert not r.error
    assert r.text.splitlines()[0] == "src/engine.py: lines 1-6 of 6"
    assert "     5      def admit(self, waiting: list) -> list:" in r.text
    page = call(registry, ctx, "read_file", path="src/engine.py", start_line=2, max_lines=2)
    assert page.text.splitlines()[0] == "src/engine.py: lines 2-3 of 6"
    assert "read on with start_line=4" in page.text
    assert page.data["end_line"] == 3


def test_read_file_lists_a_folder(registry: ToolRegistry, ctx: ToolContext) -> None:
    r = call(registry, ctx, "read_file", path=".")
    assert not r.error and "src/" in r.text and "README.md" in r.text and ".git" not in r.text


def test_read_file_missing_and_binary(registry: ToolRegistry, ctx: ToolContext) -> None:
    assert "no such file 'nope.py'" in call(registry, ctx, "read_file", path="nope.py").text
    (ctx.code_root / "blob.bin").write_bytes(b"\x00\x01" * 100)
    r = call(registry, ctx, "read_file", path="blob.bin")
    assert "binary file of 200 bytes" in r.text


@pytest.mark.parametrize("path", ["../outside.txt", "src/../../outside.txt", "/etc/passwd"])
def test_read_file_refuses_paths_out_of_the_tree(registry: ToolRegistry, ctx: ToolContext, path: str) -> None:
    (ctx.code_root.parent / "outside.txt").write_text("secret outside\n")
    r = call(registry, ctx, "read_file", path=path)
    assert r.error and repr(path) in r.text
    assert "secret outside" not in r.text and "root:" not in r.text


def test_read_file_refuses_a_symlink_out_of_the_tree(registry: ToolRegistry, ctx: ToolContext) -> None:
    os.symlink("/etc", ctx.code_root / "etc_link")
    os.symlink("/etc/passwd", ctx.code_root / "passwd_link")
    for path in ("etc_link/passwd", "passwd_link", "etc_link"):
        r = call(registry, ctx, "read_file", path=path)
        assert r.error and repr(path) in r.text and "outside the worktree" in r.text
        assert "root:" not in r.text
    listing = call(registry, ctx, "read_file", path=".")
    assert "etc_link -> (outside the code root)" in listing.text


def test_read_file_of_50_mb_is_bounded_and_quick(registry: ToolRegistry, ctx: ToolContext) -> None:
    big = ctx.code_root / "big.log"
    line = b"x" * 99 + b"\n"
    with big.open("wb") as f:
        for _ in range(50):
            f.write(line * 10_000)  # 1 MB a time; 50 MB, 500k lines
    t0 = time.monotonic()
    r = call(registry, ctx, "read_file", path="big.log", max_lines=2000)
    assert time.monotonic() - t0 < 5
    assert not r.error and len(r.text) <= registry.max_result_chars + 200
    assert r.text.splitlines()[0].startswith("big.log: lines 1-") and "of 500000" in r.text
    assert "bytes cut; read on with start_line=" in r.text
    assert r.data["cut_bytes"] > 49_000_000


def test_read_file_of_one_50_mb_line_is_bounded(registry: ToolRegistry, ctx: ToolContext) -> None:
    big = ctx.code_root / "one.min.js"
    with big.open("wb") as f:
        for _ in range(50):
            f.write(b"a" * 2**20)
    t0 = time.monotonic()
    r = call(registry, ctx, "read_file", path="one.min.js")
    assert time.monotonic() - t0 < 5
    assert not r.error and len(r.text) < 2000 and "[... line cut]" in r.text


# ---------------------------------------------------------------- search_code


def test_search_code_finds_lines(registry: ToolRegistry, ctx: ToolContext) -> None:
    r = call(registry, ctx, "search_code", pattern=r"max_running\b")
    assert not r.error
    assert "src/engine.py:2:     def __init__(self, max_running: int = 16) -> None:" in r.text
    assert r.text.startswith("3 matching lines in 1 files")
    only_tests = call(registry, ctx, "search_code", pattern="def", glob="tests/*")
    assert {m["file"] for m in only_tests.data["matches"]} == {"tests/test_engine.py"}
    py = call(registry, ctx, "search_code", pattern="def", glob="*.py", max_results=2)
    assert len(py.data["matches"]) == 2 and "stopped at max_results=2" in py.text


def test_search_code_bad_regex(registry: ToolRegistry, ctx: ToolContext) -> None:
    r = call(registry, ctx, "search_code", pattern="(unclosed")
    assert r.error and "field 'pattern': expected a Python regular expression, got '(unclosed'" in r.text


def test_search_code_does_not_follow_links_out(registry: ToolRegistry, ctx: ToolContext, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.py").write_text("MARKER_OUTSIDE = 1\n")
    os.symlink(outside, ctx.code_root / "linkdir")
    os.symlink(outside / "secret.py", ctx.code_root / "linkfile.py")
    r = call(registry, ctx, "search_code", pattern="MARKER_OUTSIDE")
    assert not r.error and r.data["matches"] == []


# ---------------------------------------------------------------- propose_diff

GOOD_DIFF = """\
diff --git a/src/engine.py b/src/engine.py
--- a/src/engine.py
+++ b/src/engine.py
@@ -1,3 +1,3 @@
 class Scheduler:
-    def __init__(self, max_running: int = 16) -> None:
+    def __init__(self, max_running: int = 64) -> None:
         self.max_running = max_running
"""


def test_propose_diff_that_applies_becomes_pending(registry: ToolRegistry, ctx: ToolContext) -> None:
    r = call(registry, ctx, "propose_diff", diff=GOOD_DIFF)
    assert not r.error, r.text
    assert "applies cleanly" in r.text and "src/engine.py" in r.text and "+1 -1" in r.text
    assert ctx.pending.diff == GOOD_DIFF
    # The code is untouched: only checked.
    assert "int = 16" in (ctx.code_root / "src" / "engine.py").read_text()
    cleared = call(registry, ctx, "propose_diff", diff="")
    assert cleared.text == "pending diff cleared" and ctx.pending.diff is None


def test_propose_diff_reports_gits_error(registry: ToolRegistry, ctx: ToolContext) -> None:
    stale = GOOD_DIFF.replace("int = 16", "int = 8")
    r = call(registry, ctx, "propose_diff", diff=stale)
    assert r.error and "git apply --check" in r.text
    assert "patch does not apply" in r.text and "src/engine.py" in r.text
    assert ctx.pending.diff is None


def test_propose_diff_refuses_protected_paths(registry: ToolRegistry, ctx: ToolContext) -> None:
    diff = GOOD_DIFF.replace("src/engine.py", "tests/test_engine.py")
    r = call(registry, ctx, "propose_diff", diff=diff)
    assert r.error and "path 'tests/test_engine.py' is protected (pattern 'tests/**')" in r.text
    rename = ("diff --git a/src/server.py b/tests/server.py\nsimilarity index 100%\n"
              "rename from src/server.py\nrename to tests/server.py\n")
    r = call(registry, ctx, "propose_diff", diff=rename)
    assert r.error and "'tests/server.py' is protected" in r.text
    assert ctx.pending.diff is None


def test_propose_diff_refuses_paths_out_of_the_tree(registry: ToolRegistry, ctx: ToolContext) -> None:
    up = GOOD_DIFF.replace("src/engine.py", "../evil.py")
    r = call(registry, ctx, "propose_diff", diff=up)
    assert r.error and "'../evil.py' leaves the code root" in r.text
    os.symlink("/etc", ctx.code_root / "etc_link")
    via_link = GOOD_DIFF.replace("src/engine.py", "etc_link/hosts")
    r = call(registry, ctx, "propose_diff", diff=via_link)
    assert r.error and "'etc_link/hosts'" in r.text and "outside the worktree" in r.text
    git_dir = GOOD_DIFF.replace("src/engine.py", ".git/config")
    assert "inside git's own folder" in call(registry, ctx, "propose_diff", diff=git_dir).text


def test_propose_diff_needs_git_prefixes(registry: ToolRegistry, ctx: ToolContext) -> None:
    bare = GOOD_DIFF.replace("a/src", "src").replace("b/src", "src")
    r = call(registry, ctx, "propose_diff", diff=bare)
    assert r.error and "a/ prefix" in r.text
    assert "no file headers" in call(registry, ctx, "propose_diff", diff="just words\n").text


def test_diff_paths_reads_renames_copies_and_quoted_names() -> None:
    diff = ('diff --git a/old.py b/new.py\nrename from old.py\nrename to new.py\n'
            'diff --git "a/sp ace.py" "b/sp ace.py"\n--- "a/sp ace.py"\n+++ "b/sp ace.py"\n'
            'diff --git a/x.py b/y.py\ncopy from x.py\ncopy to y.py\n'
            '--- /dev/null\n+++ b/added.py\t2024-01-01\n')
    assert diff_paths(diff) == ["old.py", "new.py", "sp ace.py", "x.py", "y.py", "added.py"]


def test_propose_diff_in_a_folder_of_another_repository(registry: ToolRegistry, ctx: ToolContext,
                                                        tmp_path: Path) -> None:
    import shutil
    import subprocess

    outer = tmp_path / "outer"
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    inner = outer / "pkg" / "code"
    shutil.copytree(ctx.code_root, inner, ignore=shutil.ignore_patterns(".git"))
    ctx.code_root = inner
    new_file = "--- /dev/null\n+++ b/src/added.py\n@@ -0,0 +1 @@\n+X = 1\n"
    assert not call(registry, ctx, "propose_diff", diff=GOOD_DIFF).error
    r = call(registry, ctx, "propose_diff", diff=new_file)
    assert not r.error, r.text
    assert "it replaces the previous pending diff" in r.text and ctx.pending.diff == new_file
