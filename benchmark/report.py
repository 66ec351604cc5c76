"""report.json, report.md and the PNG plots of a benchmark run (pure functions of the results).

``report.json`` (schema ``SCHEMA``) holds: ``versions`` (base and fork, as their servers
reported them), ``scenarios`` (the registry, implemented or not, with docs and reasons),
``results`` (one cell per scenario x backend x page size x variant: ``status``, ``sent``,
``identical``, ``unproven``, ``explicit_errors``, ``leaks`` + ``leak_details``, ``hangs`` +
``hang_details``, ``broken``, ``pages_reserved_after`` + ``reservations``, per-phase transfer
evidence and every judged request), ``overhead`` (``overhead.measure``) and ``summary`` (what the
exit status is computed from).

A cell's ``checks`` (scenarios that walk an operator's path, ``benchmark.incident``): one entry
per thing the operator sees at a step (``step``, ``what``, ``ok``, ``expected``, ``seen``); a
failed check of a fork cell is a fork failure (exit status 1), like a leak or a hang.

Invariant: every registered scenario appears in ``results`` for every (backend, page size,
variant) of the run, with status ``ran``, ``not_implemented``, ``not_applicable``,
``refused_to_start`` or ``error``; nothing is silently absent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmark.outcomes import Outcome, RequestRecord, count

SCHEMA = "sglang-pdsafe-benchmark/1"
CELL_STATUSES = ("ran", "not_implemented", "not_applicable", "refused_to_start", "error")
CELL_KEYS = ("scenario", "family", "backend", "page_size", "variant", "status", "reason", "sent",
             "identical", "unproven", "explicit_errors", "leaks", "leak_details", "hangs",
             "hang_details", "broken", "servers_down", "pages_reserved_after", "reservations",
             "phases",
             "notes", "duration_s", "requests", "target", "checks")
TOP_KEYS = ("schema", "created", "mode", "quick", "versions", "variants", "reference", "config",
            "scenarios", "results", "overhead", "summary", "timing", "plots")


@dataclass
class Cell:
    """The result of one scenario on one (backend, page size, variant)."""

    scenario: str
    family: str
    backend: str
    page_size: int
    variant: str
    status: str = "ran"
    reason: str = ""
    records: list[RequestRecord] = field(default_factory=list)
    reservations: dict[str, Any] | None = None
    phases: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    target: dict[str, Any] = field(default_factory=dict)
    servers_down: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return count(self.records)

    def to_json(self) -> dict[str, Any]:
        c = self.counts()
        res = self.reservations
        return {
            "scenario": self.scenario, "family": self.family, "backend": self.backend,
            "page_size": self.page_size, "variant": self.variant, "status": self.status,
            "reason": self.reason,
            "sent": c["sent"], "identical": c[Outcome.IDENTICAL.value],
            "unproven": c[Outcome.UNPROVEN.value],
            "explicit_errors": c[Outcome.EXPLICIT_ERROR.value],
            "leaks": c[Outcome.LEAK.value],
            "leak_details": [_detail(r) for r in self.records if r.outcome is Outcome.LEAK],
            "hangs": c[Outcome.HANG.value],
            "hang_details": [_detail(r) for r in self.records if r.outcome is Outcome.HANG],
            "broken": c[Outcome.BROKEN.value],
            "pages_reserved_after": None if res is None else res.get("pages_reserved"),
            "reservations": res,
            "servers_down": self.servers_down,
            "phases": self.phases, "notes": self.notes,
            "duration_s": round(self.duration_s, 2),
            "requests": [r.to_json() for r in self.records],
            "target": self.target,
            "checks": self.checks,
        }


def _detail(r: RequestRecord) -> dict[str, Any]:
    return {"request": r.label, "phase": r.phase, "path": r.path, "prompt_len": r.prompt_len,
            "status": r.status, "detail": r.detail, "content_from": r.leaked_from,
            "attribution": r.attribution, "output_head": r.output_head,
            "expected_head": r.expected_head}


def summarize(cells: Sequence[dict[str, Any]], scenarios: dict[str, dict[str, Any]],
              overhead: dict[str, Any] | None) -> dict[str, Any]:
    """Totals per variant, the fork's failing cells, the base cells that show the bug, and the
    exit status (1 when the fork leaked or hung anywhere, overhead bursts included)."""
    tot: dict[str, dict[str, int]] = {}
    for c in cells:
        t = tot.setdefault(c["variant"], {"sent": 0, "leaks": 0, "hangs": 0, "unproven": 0,
                                           "broken": 0, "explicit_errors": 0, "identical": 0})
        for k in t:
            t[k] += int(c.get(k) or 0)
    content: dict[str, dict[str, int]] = {}
    for oh in [overhead or {}, *((overhead or {}).get("additional") or [])]:
        for v, cnt in (oh.get("content") or {}).items():
            acc = content.setdefault(v, {})
            for k, n in cnt.items():
                acc[k] = acc.get(k, 0) + n
    for v, cnt in content.items():
        t = tot.setdefault(v, {"sent": 0, "leaks": 0, "hangs": 0, "unproven": 0, "broken": 0,
                               "explicit_errors": 0, "identical": 0})
        t["sent"] += cnt.get("sent", 0)
        t["leaks"] += cnt.get(Outcome.LEAK.value, 0)
        t["hangs"] += cnt.get(Outcome.HANG.value, 0)
        t["unproven"] += cnt.get(Outcome.UNPROVEN.value, 0)
        t["broken"] += cnt.get(Outcome.BROKEN.value, 0)
        t["explicit_errors"] += cnt.get(Outcome.EXPLICIT_ERROR.value, 0)
        t["identical"] += cnt.get(Outcome.IDENTICAL.value, 0)
    fork_fail = [_cell_id(c) for c in cells if c["variant"] != "base"
                 and (c.get("leaks") or c.get("hangs"))]
    failed_checks = [f"{_cell_id(c)} step {k['step']}: {k['what']}"
                     for c in cells for k in c.get("checks") or [] if not k.get("ok")]
    fork_fail += [f"{_cell_id(c)}: {n} operator-path check(s) failed"
                  for c in cells if c["variant"] != "base"
                  for n in [sum(not k.get("ok") for k in c.get("checks") or [])] if n]
    if content.get("fork", {}).get(Outcome.LEAK.value) or content.get("fork", {}).get(
            Outcome.HANG.value):
        fork_fail.append("overhead bursts (fork)")
    base_seen = [_cell_id(c) for c in cells if c["variant"] == "base"
                 and scenarios.get(c["scenario"], {}).get("known_unsafe_upstream")
                 and (c.get("leaks") or c.get("hangs"))]
    not_impl = sorted({c["scenario"] for c in cells if c["status"] == "not_implemented"})
    errors = [_cell_id(c) + f": {c['reason'][:200]}" for c in cells if c["status"] == "error"]
    crashes = [_cell_id(c) + f": {', '.join(c['servers_down'])} down"
               for c in cells if c.get("servers_down")]
    return {"totals": tot, "fork_failures": fork_fail, "base_shows_bug_in": base_seen,
            "not_implemented": not_impl, "cell_errors": errors, "server_crashes": crashes,
            "failed_checks": failed_checks, "exit_status": 1 if fork_fail else 0}


def _cell_id(c: dict[str, Any]) -> str:
    return f"{c['scenario']} [{c['backend']}, page {c['page_size']}, {c['variant']}]"


def build(meta: dict[str, Any], scenarios: dict[str, dict[str, Any]], cells: Sequence[Cell],
          overhead: dict[str, Any] | None) -> dict[str, Any]:
    """The report.json object (``meta`` carries versions, variants, config, timing...)."""
    cj = [c.to_json() for c in cells]
    rep: dict[str, Any] = {"schema": SCHEMA, **meta, "scenarios": list(scenarios.values()),
                           "results": cj, "overhead": overhead or {"status": "not_measured"},
                           "summary": summarize(cj, scenarios, overhead)}
    rep.setdefault("plots", [])
    for k in TOP_KEYS:
        rep.setdefault(k, None)
    return rep


def write_json(report: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / "report.json"
    p.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return p


# ----------------------------------------------------------------------------- markdown


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _cell_text(c: dict[str, Any]) -> str:
    if c["status"] == "not_implemented":
        return "n/i"
    if c["status"] == "not_applicable":
        return "n/a"
    if c["status"] in ("error", "refused_to_start"):
        return c["status"]
    parts = []
    if c["leaks"]:
        parts.append(f"**{c['leaks']} leak**")
    if c["hangs"]:
        parts.append(f"**{c['hangs']} hang**")
    if c["unproven"]:
        parts.append(f"{c['unproven']} unproven")
    if c["broken"]:
        parts.append(f"{c['broken']} broken")
    if c.get("servers_down"):
        parts.append(f"**{'+'.join(c['servers_down'])} died**")
    parts.append(f"{c['identical']} id / {c['explicit_errors']} err of {c['sent']}")
    checks = c.get("checks") or []
    if checks:
        bad = sum(not k.get("ok") for k in checks)
        parts.append(f"**{bad} of {len(checks)} checks failed**" if bad
                     else f"{len(checks)} checks ok")
    if c.get("pages_reserved_after"):
        parts.append(f"{c['pages_reserved_after']} pages held")
    return ", ".join(parts)


def columns(cells: Sequence[dict[str, Any]]) -> list[tuple[str, int, str]]:
    seen: list[tuple[str, int, str]] = []
    for c in cells:
        key = (c["backend"], c["page_size"], c["variant"])
        if key not in seen:
            seen.append(key)
    return seen


def _preflight_md(preflight: dict[str, list[dict[str, str]]] | None) -> list[str]:
    """Deployment mode's preflight findings (``benchmark.preflight``), errors first."""
    if not preflight:
        return []
    order = {"error": 0, "warning": 1, "note": 2}
    found = sorted(((order.get(f["level"], 3), who, f) for who, fs in preflight.items()
                    for f in fs), key=lambda x: (x[0], x[1]))
    return ["", "## Preflight", ""] + [f"- **{f['level']}** ({who}): {f['what']}"
                                       for _, who, f in found]


def markdown(report: dict[str, Any]) -> str:
    cells = report["results"]
    cols = columns(cells)
    scen = [s["name"] for s in report["scenarios"]]
    by = {(c["scenario"], c["backend"], c["page_size"], c["variant"]): c for c in cells}
    v = report.get("versions") or {}
    lines = [
        "# sglang-pdsafe regression benchmark",
        "",
        f"- mode: {report.get('mode')}{' (--quick)' if report.get('quick') else ''}; "
        f"created {report.get('created')}",
        f"- base: {v.get('base') or '-'}; fork: {v.get('fork') or '-'}",
        f"- exit status: {report['summary']['exit_status']} "
        f"(fork failures: {report['summary']['fork_failures'] or 'none'})",
        f"- base shows the bug in: {report['summary']['base_shows_bug_in'] or 'none'}",
        f"- servers that died during a scenario: "
        f"{report['summary'].get('server_crashes') or 'none'}",
        *_preflight_md(report.get("preflight")),
        "",
        "## Leak matrix",
        "",
        "Per cell: leaks and hangs (bold), answers identical to the co-located reference with the",
        "transfer proven (`id`), explicit errors (`err`), requests sent, pages still held after",
        "the scenario. `n/i`: registered, not implemented yet; `n/a`: not applicable in this mode.",
        "",
        "| scenario | " + " | ".join(f"{b} p{p} {var}" for b, p, var in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for s in scen:
        row = [by.get((s, b, p, var)) for b, p, var in cols]
        lines.append(f"| {s} | " + " | ".join(_cell_text(c) if c else "-" for c in row) + " |")
    lines += ["", "## Overhead (fork / base)", ""]
    oh = report.get("overhead") or {}
    if oh.get("status") != "measured":
        lines.append(f"Not measured: {oh.get('reason', '-')}")
    else:
        lines += _overhead_md([oh, *(oh.get("additional") or [])])
    lines += ["", "## Leaks and hangs in detail", ""]
    any_detail = False
    for c in cells:
        for kind in ("leak_details", "hang_details"):
            for d in c.get(kind) or []:
                any_detail = True
                lines.append(f"- {_cell_id(c)} {kind.split('_')[0]} `{d['request']}` "
                             f"({d['path']}, {d['prompt_len']} tokens, phase {d['phase']}): "
                             f"{d['detail']}; content from: {d['attribution'] or '-'}")
    if not any_detail:
        lines.append("None.")
    walked = [c for c in cells if c.get("checks")]
    if walked:
        lines += ["", "## Operator-path checks", ""]
        for c in walked:
            lines.append(f"- {_cell_id(c)}:")
            for k in c["checks"]:
                lines.append(f"  - {'ok' if k['ok'] else '**FAILED**'} step {k['step']}: "
                             f"{k['what']}" + ("" if k["ok"] else
                                               f" (expected `{k['expected'][:300]}`, seen "
                                               f"`{k['seen'][:300]}`)"))
    lines += ["", "## Scenarios", ""]
    for s in report["scenarios"]:
        lines.append(f"- **{s['name']}** ({s['family']}, stack `{s['stack']}`, {s['status']}"
                     f"{', deployment mode' if s['deployment_ok'] else ''}): {s['doc']}"
                     + (f" *Not run: {s['reason']}*" if s["reason"] else ""))
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})"
                                         for p in report["plots"]]
    t = report.get("timing") or {}
    if t:
        lines += ["", "## Timing", "", "```", json.dumps(t, indent=1), "```"]
    return "\n".join(lines) + "\n"


def _overhead_md(sections: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["Ratios fork/base: throughput > 1 = fork faster; latencies > 1 = fork slower. "
             "mean [min, max] over repetitions (stdev), and pooled over all samples.", "",
             "| backend | workload | reps | throughput | TTFT p50 | TTFT p99 | ITL p50 |",
             "|---|---|---|---|---|---|---|"]
    metrics = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s")
    for oh in sections:
        for w in oh["workloads"]:
            s = oh["steady"] if w == "steady" else oh["sweep"][w]
            txt = []
            for m in metrics:
                r = s["ratios"][m]
                txt.append(f"{_fmt(r['mean'])} [{_fmt(r['min'])}, {_fmt(r['max'])}] "
                           f"(sd {_fmt(r['stdev'])}); pooled {_fmt(s['pooled'][m])}")
            lines.append(f"| {oh.get('backend', '-')} | {w} | {s['reps']} | " + " | ".join(txt)
                         + " |")
    lines += ["", "Absolute (pooled over repetitions):", "",
              "| backend | workload | variant | throughput tok/s | TTFT p50 s | TTFT p99 s | "
              "ITL p50 s |", "|---|---|---|---|---|---|---|"]
    for oh in sections:
        for w in oh["workloads"]:
            s = oh["steady"] if w == "steady" else oh["sweep"][w]
            for var in ("base", "fork"):
                a = s["absolute"][var]
                lines.append(f"| {oh.get('backend', '-')} | {w} | {var} | "
                             f"{_fmt(a['throughput_tok_s'], 1)} | {_fmt(a['ttft_p50_s'], 4)} | "
                             f"{_fmt(a['ttft_p99_s'], 4)} | {_fmt(a['itl_p50_s'], 4)} |")
    for oh in sections:
        lines += ["", f"Content of the overhead answers ({oh.get('backend', '-')}): "
                      f"{oh.get('content')}"]
    return lines


def write_markdown(report: dict[str, Any], out: Path) -> Path:
    p = out / "report.md"
    p.write_text(markdown(report))
    return p


# ----------------------------------------------------------------------------- plots


def plots(report: dict[str, Any], out: Path) -> list[str]:
    """Leak-matrix heatmap, overhead ratios with spread, latency distributions (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return []
    made: list[str] = []
    cells = report["results"]
    cols = columns(cells)
    scen = [s["name"] for s in report["scenarios"]]
    by = {(c["scenario"], c["backend"], c["page_size"], c["variant"]): c for c in cells}
    if cols and scen:
        import numpy as np

        grid = np.full((len(scen), len(cols)), np.nan)
        text = [["" for _ in cols] for _ in scen]
        for i, s in enumerate(scen):
            for j, key in enumerate(cols):
                c = by.get((s, *key))
                if c is None:
                    text[i][j] = "-"
                elif c["status"] != "ran":
                    text[i][j] = {"not_implemented": "n/i", "not_applicable": "n/a"}.get(
                        c["status"], c["status"][:7])
                else:
                    grid[i, j] = (c["leaks"] or 0) + (c["hangs"] or 0)
                    text[i][j] = (f"L{c['leaks']} H{c['hangs']}" if grid[i, j]
                                  else f"ok {c['identical']}/{c['sent']}")
                    if c.get("servers_down"):
                        text[i][j] += f"\n{'+'.join(c['servers_down'])} died"
        fig, ax = plt.subplots(figsize=(3.2 + 1.4 * len(cols), 1.2 + 0.38 * len(scen)))
        cmap = matplotlib.colormaps["Reds"].with_extremes(bad="#dddddd")
        vmax = max(1.0, float(np.nanmax(grid)) if np.isfinite(grid).any() else 1.0)
        ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(cols)), [f"{b}\np{p}\n{v}" for b, p, v in cols], fontsize=8)
        ax.set_yticks(range(len(scen)), scen, fontsize=8)
        for i in range(len(scen)):
            for j in range(len(cols)):
                dark = np.isfinite(grid[i, j]) and grid[i, j] > vmax / 2
                ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
        ax.set_title("Leaks + hangs\n(grey: not run)", fontsize=9)
        fig.tight_layout()
        p = out / "leak_matrix.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(str(p))
    oh = report.get("overhead") or {}
    if oh.get("status") == "measured":
        metrics = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s")
        fig, ax = plt.subplots(figsize=(8, 4))
        ws = oh["workloads"]
        width = 0.8 / len(metrics)
        for k, m in enumerate(metrics):
            xs, ys, lo, hi = [], [], [], []
            for i, w in enumerate(ws):
                s = oh["steady"] if w == "steady" else oh["sweep"][w]
                r = s["ratios"][m]
                if r["mean"] is None:
                    continue
                xs.append(i + (k - 1.5) * width)
                ys.append(r["mean"])
                lo.append(r["mean"] - r["min"])
                hi.append(r["max"] - r["mean"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(ws)), ws)
        ax.set_ylabel("fork / base (error bars: min..max over reps)")
        ax.set_title("Protection overhead")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / "overhead_ratios.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(str(p))
        samples = oh.get("samples") or {}
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "itl_s", "ITL")):
            for v, style in (("base", "--"), ("fork", "-")):
                xs = sorted((samples.get(v) or {}).get(key) or [])
                if xs:
                    ax.plot([x * 1000 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))],
                            style, label=f"{v} (n={len(xs)})")
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel(f"{title} (ms)")
            ax.set_ylabel("CDF")
            ax.set_title(f"{title}: protections on (fork) vs off (base)")
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / "latency_distribution.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(str(p))
    return made


def write_all(meta: dict[str, Any], scenarios: dict[str, dict[str, Any]], cells: Sequence[Cell],
              overhead: dict[str, Any] | None, out: Path) -> dict[str, Any]:
    """Build the report, draw the plots, write report.json and report.md; return the report."""
    out.mkdir(parents=True, exist_ok=True)
    rep = build(meta, scenarios, cells, overhead)
    rep["plots"] = [Path(p).name for p in plots(rep, out)]
    write_json(rep, out)
    write_markdown(rep, out)
    return rep
