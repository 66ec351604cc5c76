#!/usr/bin/env python3
"""Run upstream SGLang's own disaggregation unit tests on stock 0.5.23 and on the fork.

    bash scripts/upstream-unit-tests.sh TESTS_DIR [--rev REV] [--out DIR]
                                        [--stock-upto PATCH] [--update-doc FILE] [-- PYTEST ARGS]

TESTS_DIR holds upstream's test files (``test/registered/unit/disaggregation/*.py`` of the public
sgl-project/sglang repository, at versions whose imports exist in 0.5.23). They are upstream's
code and are not part of this repository: fetch them yourself (docs/upstream-unit-tests.md).

Two trees are materialized with ``scripts/pdsafe-patches materialize`` from the patches of the
working tree (or of ``--rev``):

  stock  the pinned upstream wheel + only the CPU-enablement patches (the leading patches whose
         subject says CPU, or up to ``--stock-upto``). That is stock 0.5.23 as far as this CPU-only
         machine can import it. The tree also carries ``python/sglang/pdsafe`` (the modules commit
         comes before the patches), which nothing but 0001's CPU shim calls.
  fork   the full series.

pytest runs on TESTS_DIR once per tree (``PYTHONPATH=<tree>/python``, ``SGLANG_USE_CPU_ENGINE=1``,
``-p no:cacheprovider``, no retries, junit XML per run). The result is a markdown table
``test id | stock | fork | note``: a test that fails on stock too is "not runnable here" (the API of
that upstream test version differs from 0.5.23, or it needs a GPU); a test that passes on stock
and fails on the fork is a regression of the series, unless it is listed in ``UNSAFE`` (upstream
asserting a fail-open behaviour the fork changes on purpose).

Exit status: 0 when the fork fails no test that stock passes (other than ``UNSAFE`` ones), 1 when it
does, 2 when a tree could not be built or pytest could not run. Needs no network: the pinned wheel
comes from the build backend's cache or ``PDSAFE_UPSTREAM_WHEEL``.

This module is also the pytest plugin (``-p upstream_unit_tests``) that records each outcome.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPORT_ENV = "UPSTREAM_UNIT_TESTS_REPORT"
DOC_BEGIN = "<!-- upstream-unit-tests:table:begin -->"
DOC_END = "<!-- upstream-unit-tests:table:end -->"
INV_BEGIN = "<!-- upstream-unit-tests:inventory:begin -->"
INV_END = "<!-- upstream-unit-tests:inventory:end -->"
CPU_SUBJECT = re.compile(r"^(cpu:|.*\bCPU\b)")
SUBTESTS_FAILED = "subtests failed (see their rows)"

# Upstream tests that assert a fail-open behaviour the fork changes (or will change) on purpose.
# A fork failure of one of these is expected and does not fail the run; the reason goes in the
# table. Keys are pytest node ids relative to TESTS_DIR.
UNSAFE: dict[str, str] = {
    "test_deferred_decode_kv_release.py::TestResolveDeferredReleases"
    "::test_releases_on_timeout_without_ack": (
        "asserts the deferred-release timeout frees the decode pages although no prefill rank "
        "acked its drain (fail-open timeout: a late RDMA write lands in reused pages); the fork "
        "quarantines instead of freeing (page-ownership stage)"
    ),
    "test_deferred_decode_kv_release.py::TestResolveDeferredReleases"
    "::test_failed_release_is_isolated_and_not_retried": (
        "both entries are released through the timeout path (outcome=timeout) without any ack; "
        "same fail-open timeout as test_releases_on_timeout_without_ack"
    ),
    "test_deferred_decode_kv_release.py::TestFailedTransfersDeferOnEveryFailure"
    "::test_backend_optout_keeps_immediate_release_and_sends_no_abort": (
        "asserts a backend without a drain ack frees the destination at once and tells no "
        "prefill rank (sibling writes may still be in flight); the fork holds such pages "
        "(page-ownership stage)"
    ),
    "test_deferred_kv_release_hardening.py::TestNonDecodeInitiatedFailureDefers"
    "::test_backend_without_deferred_support_releases_immediately": (
        "same immediate release without drain proof as "
        "test_backend_optout_keeps_immediate_release_and_sends_no_abort"
    ),
    "test_deferred_kv_release_hardening.py::TestPrefillSourceReleaseWaitsForDrain"
    "::test_release_immediate_when_deferred_release_disabled": (
        "asserts prefill source pages are freed while a chunk is still in flight when the "
        "deferred release is off (prefill-side use-after-free); the fork keeps them"
    ),
    "test_deferred_kv_release_hardening.py::TestPrefillSenderPollHoldsFailedWhileOutstanding"
    "::test_failed_not_held_when_deferred_release_disabled": (
        "asserts Failed is reported (and the source released) while a chunk is in flight when "
        "the deferred release is off; same prefill-side use-after-free"
    ),
    "test_kv_checksum.py::TestPrefillHealthCheckChecksum"
    "::test_health_check_clears_metadata_checksum": (
        "asserts a rid starting with HEALTH_CHECK (client-settable) gets digest 0, i.e. no "
        "checksum; the fork verifies every request (checksum stage)"
    ),
    "test_kv_checksum.py::TestGetNewPrebuiltBatchChecksum::test_health_check_skips_checksum": (
        "asserts decode skips verification for HEALTH_CHECK rids (client-settable prefix); "
        "the fork verifies every request (checksum stage)"
    ),
    "test_kv_checksum.py::TestGetNewPrebuiltBatchChecksum::test_zero_expected_skips_checksum": (
        "asserts a zero/missing digest skips verification (fail-open); the fork refuses to "
        "commit without a digest when checksums are on (checksum stage)"
    ),
}


# --------------------------------------------------------------------------- pytest plugin
_RESULTS: dict[str, dict[str, str]] = {}


def _root_message(longrepr: Any) -> str:
    """The first line of the root-cause exception of a failed report.

    sglang's CustomTestCase wraps every failure in ``retry()``; the chained original is the one
    that names the cause, so take the first chain entry that is not the retry wrapper.
    """
    chain = getattr(longrepr, "chain", None)
    crashes = [c for _, c, _ in chain if c is not None] if chain else []
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and not crashes:
        crashes = [crash]
    for c in crashes:
        if not c.message.startswith("Exception: retry()"):
            return c.message.splitlines()[0] if c.message else ""
    text = str(longrepr)
    errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if errors:
        return errors[-1]
    return text.strip().splitlines()[-1] if text.strip() else ""


def _subtest_suffix(report: Any) -> str:
    ctx = report.context
    parts = []
    if ctx.msg is not None:
        parts.append(f"[{ctx.msg}]")
    if ctx.kwargs:
        parts.append("(" + ", ".join(f"{k}={v}" for k, v in ctx.kwargs.items()) + ")")
    return " ".join(parts) or "(<subtest>)"


def pytest_runtest_logreport(report: Any) -> None:
    """Record the outcome of each test (and each failed subtest) by node id."""
    key = report.nodeid
    if getattr(report, "context", None) is not None:  # a subtest
        key = f"{report.nodeid} {_subtest_suffix(report)}"
        if report.passed:
            return  # passing subtests are summarised by their parent's row
        _RESULTS.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        _RESULTS[report.nodeid]["subtest_failed"] = "1"
    entry = _RESULTS.setdefault(key, {"outcome": "passed", "message": ""})
    if report.when == "call" or getattr(report, "context", None) is not None:
        if report.skipped:
            entry["outcome"] = "skipped"
            entry["message"] = str(report.longrepr[-1]) if isinstance(
                report.longrepr, tuple) else ""
        elif report.failed:
            entry["outcome"] = "failed"
            entry["message"] = _root_message(report.longrepr)
    elif report.failed:  # setup or teardown error
        entry["outcome"] = "error"
        entry["message"] = _root_message(report.longrepr)
    elif report.skipped and report.when == "setup":
        entry["outcome"] = "skipped"
        entry["message"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""


def pytest_collectreport(report: Any) -> None:
    """A module that does not import is one row: ``<file> (collection)``."""
    if report.failed:
        _RESULTS[f"{report.nodeid} (collection)"] = {
            "outcome": "error", "message": _root_message(report.longrepr)}


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        for entry in _RESULTS.values():  # a parent whose subtests failed did not pass
            if entry.pop("subtest_failed", None) and entry["outcome"] == "passed":
                entry["outcome"] = "failed"
                entry["message"] = SUBTESTS_FAILED
        Path(path).write_text(json.dumps(_RESULTS, indent=1, sort_keys=True))


# --------------------------------------------------------------------------- the inventory
def _load_ci_register(tree: Path) -> Any:
    """Upstream's own CI registration parser (``sglang/test/ci/ci_register.py`` of ``tree``),
    loaded from its file: it needs only the standard library, not sglang."""
    path = tree / "python" / "sglang" / "test" / "ci" / "ci_register.py"
    spec = importlib.util.spec_from_file_location("_upstream_ci_register", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"no ci_register.py in {tree}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def _defined(module_file: Path) -> set[str]:
    """Top-level names a module defines (functions, classes, assignments, imports)."""
    import ast

    names: set[str] = set()
    for node in ast.parse(module_file.read_text(errors="replace")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for tg in targets for n in ast.walk(tg) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module_file(tree: Path, module: str) -> Path | None:
    """The file of ``module`` in ``tree`` (a package without ``__init__.py``: its directory)."""
    base = tree / "python" / Path(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return base if base.is_dir() else None


def missing_imports(test_file: Path, tree: Path) -> list[str]:
    """The ``sglang`` modules and names ``test_file`` imports that ``tree`` lacks (static:
    a test version written for another release names what 0.5.23 does not have)."""
    import ast

    out: list[str] = []
    for node in ast.walk(ast.parse(test_file.read_text(errors="replace"))):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names if a.name.split(".")[0] == "sglang"]
            out += [m for m in mods if _module_file(tree, m) is None]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "sglang":
            mf = _module_file(tree, node.module or "")
            if mf is None:
                out.append(node.module or "")
                continue
            have = _defined(mf) if mf.is_file() else set()
            out += [f"{node.module}.{a.name}" for a in node.names
                    if a.name != "*" and a.name not in have
                    and _module_file(tree, f"{node.module}.{a.name}") is None]
    return sorted(set(out))


def inventory(tests: Path, tree: Path) -> list[dict[str, Any]]:
    """Every ``test_*.py`` of ``tests``: upstream's CPU registration (``register_cpu_ci``, read
    by the tree's own ``ci_register.ut_parse_one_file``), and what it imports that ``tree``
    lacks. ``run`` is True for the files the comparison runs: registered for CPU (not
    disabled) and importable on the pinned release."""
    ci = _load_ci_register(tree)
    rows = []
    for f in sorted(tests.glob("test_*.py")):
        regs, _ = ci.ut_parse_one_file(str(f))
        cpu = [r for r in regs if r.backend == ci.HWBackend.CPU]
        enabled = [r for r in cpu if r.disabled is None]
        absent = missing_imports(f, tree)
        rows.append({
            "file": f.name,
            "cpu": bool(cpu), "cpu_enabled": bool(enabled),
            "suites": sorted({str(r.effective_suite) for r in enabled}),
            "other_backends": sorted({r.backend.name for r in regs} - {"CPU"}),
            "missing_imports": absent,
            "run": bool(enabled) and not absent,
        })
    return rows


def render_inventory(rows: list[dict[str, Any]]) -> str:
    lines = [f"{sum(r['run'] for r in rows)} of {len(rows)} files run: registered for CPU and "
             "importable on the pinned release.", "",
             "| file | upstream CI registration | imports missing from the pinned release | run |",
             "|---|---|---|---|"]
    for r in rows:
        reg = ("CPU (" + ", ".join(r["suites"]) + ")" if r["cpu_enabled"] else
               "CPU, disabled" if r["cpu"] else
               "not CPU: " + (", ".join(r["other_backends"]) or "none"))
        miss = ", ".join(f"`{m}`" for m in r["missing_imports"][:4]) or "-"
        if len(r["missing_imports"]) > 4:
            miss += f" (+{len(r['missing_imports']) - 4})"
        lines.append(f"| `{r['file']}` | {reg} | {miss} | {'yes' if r['run'] else 'no'} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the runner
def _run(cmd: list[str], cwd: Path, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, text=True, capture_output=True, **kw)


def _git(cwd: Path, *args: str) -> str:
    proc = _run(["git", *args], cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr}")
    return proc.stdout


@contextmanager
def _source_checkout(rev: str | None) -> Iterator[Path]:
    """The repository whose patches/ and scripts/ build the trees: this working tree, or a
    temporary ``git worktree`` of ``rev`` (removed afterwards; the main checkout is untouched)."""
    if rev is None:
        yield ROOT
        return
    tmp = Path(tempfile.mkdtemp(prefix="uut-src-"))
    src = tmp / "src"
    _git(ROOT, "worktree", "add", "--detach", str(src), rev)
    try:
        yield src
    finally:
        _run(["git", "worktree", "remove", "--force", str(src)], ROOT)
        shutil.rmtree(tmp, ignore_errors=True)


def _series(src: Path) -> list[tuple[str, str]]:
    """(file name, subject) of every patch in ``src``'s patches/series, in order."""
    names = [ln.strip() for ln in (src / "patches" / "series").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    out = []
    for name in names:
        head = (src / "patches" / name).read_text(errors="replace").split("\n---\n", 1)[0]
        m = re.search(r"(?m)^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n [^\n]*)*)", head)
        subject = " ".join(m.group(1).split()) if m else name
        out.append((name, subject))
    return out


def _stock_patches(series: list[tuple[str, str]], upto: str | None) -> list[str]:
    if upto:
        hits = [i for i, (n, _) in enumerate(series) if n.startswith(upto)]
        if len(hits) != 1:
            raise RuntimeError(f"--stock-upto {upto}: matches {len(hits)} patches")
        return [n for n, _ in series[: hits[0] + 1]]
    stock = []
    for name, subject in series:
        if not CPU_SUBJECT.match(subject):
            break
        stock.append(name)
    if not stock:
        raise RuntimeError("no leading CPU-enablement patch found; pass --stock-upto")
    return stock


def build_trees(src: Path, out: Path, upto: str | None, python: str) -> dict[str, Any]:
    """Materialize the fork tree and extract the stock tree from its history."""
    fork, stock = out / "fork", out / "stock"
    t0 = time.monotonic()
    proc = _run([python, str(src / "scripts" / "pdsafe-patches"), "materialize", str(fork),
                 "--force"], src)
    if proc.returncode != 0:
        raise RuntimeError(f"materialize failed:\n{proc.stdout}{proc.stderr}")
    series = _series(src)
    stock_names = _stock_patches(series, upto)
    revs = _git(fork, "rev-list", "--reverse", "pdsafe-modules..HEAD").split()
    if len(revs) != len(series):
        raise RuntimeError(f"{fork}: {len(revs)} patch commits for {len(series)} patches")
    stock_rev = revs[len(stock_names) - 1]
    if stock.exists():
        shutil.rmtree(stock)
    stock.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", "--format=tar", stock_rev, "python"],
                               cwd=fork, stdout=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", str(stock)], stdin=archive.stdout)
    if archive.wait() != 0 or tar.returncode != 0:
        raise RuntimeError(f"could not extract {stock_rev} from {fork}")
    digest = hashlib.sha256()
    for name, _ in series:
        digest.update((src / "patches" / name).read_bytes())
    return {
        "source": str(src), "source_head": _git(src, "rev-parse", "--short", "HEAD").strip(),
        "series_sha256": digest.hexdigest()[:12],
        "series": [n for n, _ in series], "stock_patches": stock_names,
        "stock_rev": stock_rev, "seconds": round(time.monotonic() - t0, 1),
    }


def _shim_dir(out: Path) -> Path | None:
    """``sglang.test.test_utils`` (imported by most upstream tests) imports HF ``datasets``
    through sglang.benchmark; the CPU profile does not install it. A stub whose
    ``load_dataset`` raises stands in when it is absent, for both trees alike."""
    if importlib.util.find_spec("datasets") is not None:
        return None
    shim = out / "shim"
    (shim / "datasets").mkdir(parents=True, exist_ok=True)
    (shim / "datasets" / "__init__.py").write_text(
        '"""Stub: HF datasets is not installed (upstream-unit-tests runner)."""\n\n\n'
        "def load_dataset(*args, **kwargs):\n"
        '    raise ImportError("datasets is not installed (upstream-unit-tests shim)")\n'
    )
    return shim


def run_pytest(name: str, tree: Path, tests: Path, out: Path, python: str,
               extra: list[str], files: list[str] | None = None
               ) -> tuple[dict[str, dict[str, str]], float, int]:
    report = out / f"results-{name}.json"
    report.unlink(missing_ok=True)
    paths = [str(tree / "python"), str(Path(__file__).resolve().parent)]
    shim = _shim_dir(out)
    if shim is not None:
        paths.insert(1, str(shim))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "SGLANG_IS_IN_CI", "CI")
           and not k.startswith("SGLANG_PDSAFE_")}
    env.update({
        "PYTHONPATH": os.pathsep.join(paths), "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_TEST_MAX_RETRY": "0", "PYTHONDONTWRITEBYTECODE": "1",
        "SGLANG_HOST_IP": "127.0.0.1", "UCX_NET_DEVICES": "lo", "MOONCAKE_PROTOCOL": "tcp",
        REPORT_ENV: str(report),
    })
    ini = out / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "upstream_unit_tests",
           "-c", str(ini), "--rootdir", str(tests), "-q", "-rN", "--tb=short",
           f"--junitxml={out / f'junit-{name}.xml'}", "-o", "junit_family=xunit2"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["-o", "timeout=300"]
    cmd += [*extra, *([str(tests / f) for f in files] if files is not None else [str(tests)])]
    t0 = time.monotonic()
    with open(out / f"pytest-{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - t0
    if not report.exists():
        raise RuntimeError(f"pytest on {name} wrote no report (exit {rc}); see "
                           f"{out / f'pytest-{name}.log'}")
    return json.loads(report.read_text()), seconds, rc


_MARK = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip", None: "-"}


def _error_class(message: str) -> str:
    m = re.match(r"\s*([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)?)\s*:", message)
    return m.group(1) if m else (message.split(":", 1)[0][:60] or "failure")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]


def _lookup(results: dict[str, dict[str, str]], key: str) -> dict[str, str] | None:
    """The outcome of ``key`` in one run. Only failed subtests are recorded, so a subtest row
    missing from a run whose parent test ran means that subtest passed there."""
    if key in results:
        return results[key]
    parent = key.split(" ", 1)[0]
    if parent != key and results.get(parent, {}).get("outcome") in ("passed", "failed"):
        return {"outcome": "passed", "message": ""}
    return None


def classify(stock: dict[str, dict[str, str]], fork: dict[str, dict[str, str]]
             ) -> tuple[list[tuple[str, str, str, str]], dict[str, list[str]]]:
    """Rows (id, stock, fork, note) and the ids per category."""
    rows, cats = [], {"regression": [], "unsafe": [], "not_runnable": [], "fork_only": [],
                      "same": [], "skipped": [], "parent": []}
    for key in sorted(set(stock) | set(fork)):
        s, f = _lookup(stock, key), _lookup(fork, key)
        so, fo = (s or {}).get("outcome"), (f or {}).get("outcome")
        s_msg = s["message"] if s else "absent"
        f_msg = f["message"] if f else "absent"
        unsafe = UNSAFE.get(key.split(" ", 1)[0])
        note = ""
        msgs = {m for m, o in ((s_msg, so), (f_msg, fo)) if o == "failed"}
        if msgs == {SUBTESTS_FAILED}:  # only its subtests failed: they have their own rows
            cat, note = "parent", SUBTESTS_FAILED
        elif so == "passed" and fo == "passed":
            cat = "same"
        elif so == "skipped" and fo == "skipped":
            cat, note = "skipped", f"skipped: {s_msg}"
        elif so == "passed":
            cat = "unsafe" if unsafe else "regression"
            note = ("" if unsafe else "**REGRESSION** ") + f"fork: {f_msg}"
        elif fo == "passed":
            cat = "fork_only"
            note = f"passes on the fork only (stock: {_error_class(s_msg)})"
        else:
            cat = "not_runnable"
            note = f"not runnable here ({_error_class(s_msg)})"
            if _error_class(f_msg) != _error_class(s_msg):
                note += f"; fork: {_error_class(f_msg)}"
        if unsafe:
            note = (note + "; " if note else "") + f"unsafe-behaviour test: {unsafe}"
        cats[cat].append(key)
        rows.append((key, _MARK.get(so, so), _MARK.get(fo, fo), note))
    return rows, cats


def render(rows: list[tuple[str, str, str, str]], cats: dict[str, list[str]],
           meta: dict[str, Any]) -> str:
    lines = [
        (f"Source: `{meta['rev']}` = `{meta['source_head']}`" if meta.get("rev") else
         f"Source: working tree on `{meta['source_head']}`") + ", "
        f"patches sha256 {meta.get('series_sha256', '?')}; "
        f"stock = pinned wheel + {', '.join(p[:4] for p in meta['stock_patches'])}; "
        f"fork = all {len(meta['series'])} patches. "
        f"pytest: stock {meta['stock_seconds']:.0f} s, fork {meta['fork_seconds']:.0f} s; "
        f"trees {meta['seconds']:.0f} s.",
        "",
        f"Summary: {len(cats['same'])} pass on both, "
        f"**{len(cats['regression'])} pass on stock and fail on the fork**, "
        f"{len(cats['unsafe'])} unsafe-behaviour tests failing on the fork (expected), "
        f"{len(cats['not_runnable'])} not runnable here (fail on stock too), "
        f"{len(cats['fork_only'])} pass on the fork only, {len(cats['skipped'])} skipped "
        "(a test with subtests counts once per failed subtest; passing subtests are not listed).",
        "",
        "| test id | stock | fork | note |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{_cell(k)}` | {s} | {f} | {_cell(n)} |" for k, s, f, n in rows]
    return "\n".join(lines) + "\n"


def update_doc(doc: Path, table: str, begin: str = DOC_BEGIN, end: str = DOC_END) -> None:
    text = doc.read_text()
    if begin not in text or end not in text:
        raise RuntimeError(f"{doc} has no {begin} ... {end} region")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{table}{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, epilog="after --: extra pytest arguments",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", type=Path, help="directory of upstream test files")
    ap.add_argument("--rev", help="build the trees from this commit's patches/ (git worktree)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "upstream-unit-tests")
    ap.add_argument("--stock-upto", help="last patch of the stock tree (number or name prefix; "
                    "default: the leading patches whose subject says CPU)")
    ap.add_argument("--update-doc", type=Path, help="rewrite the table region of this file")
    ap.add_argument("--all-files", action="store_true",
                    help="run every test_*.py of TESTS_DIR, not only the ones upstream registers "
                    "for CPU and the pinned release can import (the inventory)")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the table from the results already in --out (no trees, no "
                    "pytest)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    tests = args.tests.resolve()
    if not any(tests.glob("test_*.py")):
        print(f"{tests}: no test_*.py files", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    if args.report_only:
        meta = json.loads((out / "meta.json").read_text())
        results = {n: json.loads((out / f"results-{n}.json").read_text())
                   for n in ("stock", "fork")}
        return _report(results, meta, out, args.update_doc)
    try:
        with _source_checkout(args.rev) as src:
            meta = build_trees(src, out, args.stock_upto, python)
        meta["rev"] = args.rev
        print(f"trees in {out} ({meta['seconds']} s); stock = {', '.join(meta['stock_patches'])}",
              flush=True)
        inv = inventory(tests, out / "stock")
        meta["inventory"] = inv
        (out / "inventory.md").write_text(render_inventory(inv))
        files = None if args.all_files else [r["file"] for r in inv if r["run"]]
        results = {}
        for name in ("stock", "fork"):
            res, seconds, rc = run_pytest(name, out / name, tests, out, python, extra, files)
            results[name] = res
            meta[f"{name}_seconds"] = seconds
            print(f"pytest on {name}: exit {rc}, {len(res)} rows, {seconds:.0f} s", flush=True)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return _report(results, meta, out, args.update_doc)


def _report(results: dict[str, dict[str, dict[str, str]]], meta: dict[str, Any], out: Path,
            doc: Path | None) -> int:
    rows, cats = classify(results["stock"], results["fork"])
    table = render(rows, cats, meta)
    (out / "table.md").write_text(table)
    print(table)
    if doc:
        update_doc(doc.resolve(), table)
        if meta.get("inventory") is not None:
            update_doc(doc.resolve(), render_inventory(meta["inventory"]), INV_BEGIN, INV_END)
        print(f"updated {doc}")
    for key in cats["regression"]:
        print(f"REGRESSION {key}: {results['fork'].get(key, {}).get('message', 'absent')}",
              file=sys.stderr)
    return 1 if cats["regression"] else 0


if __name__ == "__main__":
    sys.exit(main())
