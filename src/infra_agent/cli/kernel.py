"""``infra-agent kernel check|bench SPEC``: the kernel lab from the command line.

Exit status: 0 when everything that ran passed; 1 when a check fails or bench
refuses an entry (speed is never reported for those) or an entry raises while timed;
2 on a user error (broken spec, unknown ``--precision``/``--variant``); 3 when nothing
was checked at all (every case skipped: ``--device cuda`` without a GPU, a GPU-only
spec on the CPU), so a run that judged nothing is never mistaken for a pass.

Checks run in a worker process with ``--timeout-s`` per kernel call: a kernel that
hangs or crashes its process is a failed row (``TIMEOUT`` / ``CRASHED``), and the other
calls still run.  Progress goes to stderr: a live bar on a terminal, a plain line
every few seconds otherwise (CI, log files).
"""

from __future__ import annotations

from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from infra_agent.cli.output import emit, err_console, user_errors

NOTHING_CHECKED_EXIT = 3
TIMEOUT_HELP = (
    "Seconds each kernel call may take in the check worker before it is killed and recorded as a timeout "
    "(default: the spec's timeout_s, else 60); 0 runs the calls in this process without a timeout."
)


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _ulp_note(report: Any) -> str | None:
    if not any(r.stats is not None for r in report.rows()):
        return None
    from infra_agent.lab.spec import DEFAULT_ULP_FLOOR

    return (
        f"  ULP: max over elements with |ref| >= ulp_floor x RMS of the reference (default {DEFAULT_ULP_FLOOR:g}); "
        "near zero a tiny ULP turns any absolute error into millions of ULP (max_ulp_all in the JSON counts every element)"
    )


def _render_check(console: Console, report: Any, show_skipped: bool = True) -> None:
    from infra_agent.lab.correctness import CheckReport

    assert isinstance(report, CheckReport)
    title = f"{report.spec}  ({report.device}, seeds {report.seeds})"
    table = Table(title=title, title_justify="left")
    for col in ("variant", "vs", "precision", "output", "max abs", "max rel", "ULP", "rel fro", "tolerance", "result", "worst idx", "condition"):
        table.add_column(col, overflow="fold")
    for r in report.rows():
        s = r.stats
        verdict = "[green]pass[/]" if r.status == "passed" else "[bold red]" + {"timeout": "TIMEOUT", "crashed": "CRASHED"}.get(r.fault or "", "FAIL") + "[/]"
        cond = f"{r.shape} {r.dtype} seed={r.seed}"
        table.add_row(
            r.variant, r.against, r.precision, r.output,
            _fmt(s.max_abs if s else None), _fmt(s.max_rel if s else None), _fmt(s.max_ulp if s else None, ".0f"),
            _fmt(s.rel_fro if s else None), r.tolerance, verdict,
            str(list(s.worst_index)) if s else "-", cond if s else f"{cond}: {r.message}",
        )
    if report.rows():  # an all-skipped report has no table, only its reasons
        console.print(table)
        note = _ulp_note(report)
        if note:
            console.print(note, highlight=False, style="dim")
    for r in report.rows():
        if r.status == "failed" and (r.fault in ("timeout", "crashed") or (r.stats is not None and r.stats.reason)):
            label = {"timeout": "TIMEOUT", "crashed": "CRASHED"}.get(r.fault or "", "FAIL")
            console.print(f"  [red]{label}[/] {r.condition.label() if r.condition else ''}: {r.message}", highlight=False)
    for msg in report.notes:
        console.print(f"  [yellow]note[/] {msg}", highlight=False)
    for msg in report.skipped if show_skipped else ():
        console.print(f"  [yellow]skipped[/] {msg}", highlight=False)


def _render_bench(console: Console, report: Any) -> None:
    from infra_agent.lab.findings import launch_bound, launch_bound_finding
    from infra_agent.lab.microbench import BenchReport

    assert isinstance(report, BenchReport)
    for check in report.checks:
        _render_check(console, check, show_skipped=False)  # report.skipped has them all
    c = report.ceilings
    if c is not None:
        console.print(f"[bold]ceilings measured in this run on {c.device}:[/] " + "; ".join(c.notes), highlight=False)
    table = Table(title=f"{report.spec} timing", title_justify="left")
    # On a GPU "median µs" is GPU time (launch hidden) and "host µs" the host's time per
    # call (Python + launch); host above GPU is a launch-bound kernel.  "-" on the CPU.
    # "vs copy": a plain copy of the entry's bytes timed the same way, over the entry's time
    # (roofline.time_copy_of); 100% moves its bytes as fast as this size allows.
    for col in ("variant", "precision", "shape", "median µs", "95% CI µs", "host µs", "GB/s", "GFLOP/s", "bound", "fraction", "headroom", "vs copy",
                "status"):
        table.add_column(col, overflow="fold")
    for e in report.entries:
        t, rl = e.timing, e.roofline
        host = t.host_median_s if t else None
        bound = bool(t and launch_bound(t))
        table.add_row(
            e.variant, e.precision, f"{e.shape} {e.dtype}",
            _fmt(t.median_s * 1e6 if t else None, ".4g"),
            f"[{t.ci_low_s * 1e6:.4g}, {t.ci_high_s * 1e6:.4g}]" if t else "-",
            ("[yellow]" if bound else "") + _fmt(host * 1e6 if host is not None else None, ".4g") + (" launch-bound[/]" if bound else ""),
            _fmt(rl.achieved_Bps / 1e9 if rl and rl.achieved_Bps else None, ".4g"),
            _fmt(rl.achieved_flops_per_s / 1e9 if rl and rl.achieved_flops_per_s else None, ".4g"),
            rl.bound if rl else "-",
            _fmt(rl.fraction if rl else None, ".1%"), _fmt(rl.headroom if rl else None, ".1%"),
            _fmt(rl.vs_copy_same_bytes if rl else None, ".1%"),
            (e.status + (f": {e.message}" if e.message else "")) if e.status == "timed" else f"[red]{e.status}[/]: {e.message}",
        )
    if report.entries:
        console.print(table)
    for key, t in report.copies.items():
        # The copy's own share of the ceiling, from an entry set beside it (none: every entry of this
        # input is compute-bound, and the copy sets nothing beside them).
        share = next((e.roofline.copy_fraction for e in report.entries
                      if e.input_key == key and e.roofline and e.roofline.copy_fraction is not None), None)
        if share is not None:
            console.print(f"  a plain copy of the bytes of [{key}] takes {t.median_s * 1e6:.4g} µs in this timing, "
                          f"{share:.1%} of the copy ceiling", highlight=False)
    for e in report.entries:
        found = launch_bound_finding(report.spec, report.origin, e)
        if found is not None:
            console.print(f"  [yellow]launch-bound[/] {found.message}; {found.next_question}", highlight=False)
    if report.work:
        work = Table(title=f"{report.spec} work accounting", title_justify="left")
        for col in ("variant", "shape", "op", "calls", "distinct keys", "repeat x", "repeated FLOP", "share of counted"):
            work.add_column(col)
        for variant, counted in report.work.items():
            for op in counted["ops"]:
                share = op["repeated_flops"] / counted["total_flops"] if counted["total_flops"] else 0.0
                work.add_row(variant, counted["shape"], op["op"], str(op["calls"]), str(op["unique_keys"]),
                             f"{op['repeat_factor']:.3g}", f"{op['repeated_flops']:.4g}", f"{share:.1%}")
        console.print(work)
    for msg in report.skipped:
        console.print(f"  [yellow]skipped[/] {msg}", highlight=False)


def _run(mode: str, spec_path: str, spec_name: str | None, config: dict[str, Any], as_json: bool) -> None:
    from infra_agent.lab.loader import load_specs, select
    from infra_agent.lab.progress import LabProgress
    from infra_agent.probes.kernel import run_lab

    with user_errors(as_json):
        specs = select(load_specs(spec_path), spec_name)
        # stderr: a live bar on a terminal, plain periodic lines in CI and log files.
        with LabProgress(mode, console=err_console) as progress:
            fb, reports = run_lab(specs, mode, config, progress=progress)
    checked = int(fb.meta["checked"])
    result = {
        "ok": fb.ok, "mode": mode, "checked": checked, "skipped": fb.meta["skipped"],
        "reports": [r.to_dict() for r in reports], "feedback": fb.model_dump(mode="json"),
    }
    render = _render_bench if mode == "bench" else _render_check

    def show(console: Console) -> None:
        for r in reports:
            render(console, r)
        if checked == 0:
            console.print(f"[bold yellow]NOTHING CHECKED[/]: every case was skipped (reasons above); exit {NOTHING_CHECKED_EXIT}")
        else:
            console.print("[green]ok[/]" if fb.ok else f"[bold red]FAILED[/]: {fb.error}")

    emit(result, as_json, show)
    if checked == 0:
        raise typer.Exit(code=NOTHING_CHECKED_EXIT)
    if not fb.ok:
        raise typer.Exit(code=1)


def register(app: typer.Typer) -> None:
    kernel = typer.Typer(help="Kernel lab: correctness across variants and precisions, microbenchmarks, roofline.", no_args_is_help=True)

    @kernel.command("check")
    def check(
        spec: str = typer.Argument(..., help="Path to a spec file (Python, declares KernelSpec objects)."),
        spec_name: Optional[str] = typer.Option(None, "--spec-name", help="Only this spec of the file."),
        seeds: int = typer.Option(2, "--seeds", min=1, help="How many fresh random seeds to draw per run; one set shared by every shape and dtype (unless the spec pins them)."),
        device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
        precision: Optional[list[str]] = typer.Option(None, "--precision", help="Only these precision modes (repeatable)."),
        variant: Optional[list[str]] = typer.Option(None, "--variant", help="Only these partition variants (repeatable)."),
        timeout_s: Optional[float] = typer.Option(None, "--timeout-s", min=0, help=TIMEOUT_HELP),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Candidate vs reference and every partition variant vs the unpartitioned kernel."""
        config = {"seeds": seeds, "device": device, "precisions": precision or None, "variants": variant or None, "timeout_s": timeout_s}
        _run("check", spec, spec_name, config, as_json)

    @kernel.command("bench")
    def bench(
        spec: str = typer.Argument(..., help="Path to a spec file."),
        spec_name: Optional[str] = typer.Option(None, "--spec-name", help="Only this spec of the file."),
        device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
        seeds: int = typer.Option(2, "--seeds", min=1, help="Fresh random seeds for the correctness gate; one set shared by every shape and dtype."),
        precision: Optional[list[str]] = typer.Option(None, "--precision", help="Only these precision modes (repeatable)."),
        variant: Optional[list[str]] = typer.Option(None, "--variant", help="Only these partition variants (repeatable)."),
        budget_s: float = typer.Option(0.3, "--budget-s", help="CPU timing budget per entry, seconds."),
        copy_mib: Optional[int] = typer.Option(None, "--copy-mib", help="Size of the bandwidth-ceiling copy (default 256 CPU / 1024 GPU)."),
        matmul_n: Optional[int] = typer.Option(None, "--matmul-n", help="n of the n^3 compute-ceiling matmul (default 1024 CPU / 8192 GPU)."),
        timeout_s: Optional[float] = typer.Option(None, "--timeout-s", min=0, help=TIMEOUT_HELP),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Check first, then time every passing (variant, precision) against ceilings measured now."""
        config = {
            "seeds": seeds, "device": device, "precisions": precision or None, "variants": variant or None, "timeout_s": timeout_s,
            "budget_s": budget_s, "copy_bytes": copy_mib * 2**20 if copy_mib else None, "matmul_n": matmul_n,
        }
        _run("bench", spec, spec_name, config, as_json)

    app.add_typer(kernel, name="kernel")
