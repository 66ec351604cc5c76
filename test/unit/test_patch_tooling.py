"""The patch-series checker (``scripts/pdsafe-patches check``): header vocabulary, ``Tests:``
references and revert-clean series. Starts no server and imports no sglang: the header
functions are pure, the CLI runs ``check --headers-only`` on a temporary patch directory, and
the revert check runs on a two-file synthetic tree.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pdsafe-patches"
THIS = "test/unit/test_patch_tooling.py"


def _load_script() -> ModuleType:
    """The script as a module (its file name has no .py); sys.path is left as it was."""
    saved = list(sys.path)
    try:
        loader = importlib.machinery.SourceFileLoader("pdsafe_patches", str(SCRIPT))
        spec = importlib.util.spec_from_loader("pdsafe_patches", loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        loader.exec_module(mod)
        return mod
    finally:
        sys.path[:] = saved


pp = _load_script()


def _patch(**fields: str | None) -> str:
    """A git format-patch text with a valid header; ``fields`` replace (or, as None, drop)
    From, Subject, Why, Forwarded, Upstream-Status, Tests."""
    values: dict[str, str | None] = {
        "From": "sglang-pdsafe <pdsafe@localhost>",
        "Subject": "[PATCH] disaggregation/decode: check the thing",
        "Why": "without it the thing goes\nunchecked (wrapped line).",
        "Forwarded": "no",
        "Upstream-Status": "Pending",
        "Tests": f"{THIS}::test_good_header_passes, {THIS}::TestRefResolution::test_method_ref",
    }
    values.update(fields)
    mail = [f"{k}: {values[k]}" for k in ("From", "Subject") if values[k] is not None]
    body = [f"{k}: {values[k]}" for k in ("Why", "Forwarded", "Upstream-Status", "Tests")
            if values[k] is not None]
    return ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            + "\n".join(mail) + "\nDate: Mon, 30 Nov 2026 00:00:00 +0000\n\n"
            + "\n\n".join(body) + "\n---\n python/sglang/x.py | 1 +\n\n"
            "diff --git a/python/sglang/x.py b/python/sglang/x.py\n")


def _errors(**fields: str | None) -> list[str]:
    return pp.validate_patch_header("0042-test.patch", _patch(**fields), ROOT)


def test_good_header_passes() -> None:
    assert _errors() == []


def test_folded_from_and_bracketed_statuses_pass() -> None:
    text = _patch(**{"Upstream-Status": "Submitted [https://github.com/sgl-project/sglang/pull/1]",
                     "Forwarded": "https://github.com/sgl-project/sglang/pull/1"})
    text = text.replace("From: sglang-pdsafe <pdsafe@localhost>",
                        "From: sglang-pdsafe\n <pdsafe@localhost>")
    assert pp.validate_patch_header("0042-test.patch", text, ROOT) == []
    assert _errors(**{"Upstream-Status": "Inappropriate [fork-specific report]",
                      "Forwarded": "not-needed"}) == []
    assert _errors(**{"Upstream-Status": "Backport v0.5.24", "Forwarded": "not-needed"}) == []


def test_second_author_identity_fails() -> None:
    errs = _errors(From="Seed maintainers <maintainers@example.org>")
    assert len(errs) == 1
    assert errs[0].startswith("0042-test.patch: From:")
    assert "maintainers@example.org" in errs[0] and "sglang-pdsafe <pdsafe@localhost>" in errs[0]


def test_free_text_upstream_status_fails() -> None:
    errs = _errors(**{"Upstream-Status": "not yet submitted; related #38704"})
    assert len(errs) == 1 and "0042-test.patch: Upstream-Status:" in errs[0]
    assert "not yet submitted" in errs[0]
    assert "Pending, Submitted, Backport, Inappropriate" in errs[0]


@pytest.mark.parametrize("status, why", [
    ("Submitted", "needs a URL or an upstream ref"),
    ("Submitted soon", "needs a URL or an upstream ref"),
    ("Backport", "needs a URL or an upstream ref"),
    ("Inappropriate", "needs a reason"),
    ("Pending, see #1", "first word"),
    ("Pending see #1", "Pending takes no text"),
])
def test_status_without_its_argument_fails(status: str, why: str) -> None:
    errs = _errors(**{"Upstream-Status": status})
    assert any(why in e for e in errs), errs


def test_missing_forwarded_fails() -> None:
    assert _errors(Forwarded=None) == ["0042-test.patch: missing Forwarded:"]


def test_forwarded_outside_the_vocabulary_fails() -> None:
    errs = _errors(Forwarded="yes, to the mailing list")
    assert len(errs) == 1 and "Forwarded: 'yes, to the mailing list'" in errs[0]


@pytest.mark.parametrize("field", ["Subject", "Why", "Tests", "Upstream-Status", "From"])
def test_every_required_field_is_required(field: str) -> None:
    assert f"0042-test.patch: missing {field}:" in _errors(**{field: None})


def test_subject_must_name_an_area() -> None:
    errs = _errors(Subject="[PATCH] Check the thing")
    assert len(errs) == 1 and "is not '<area>: <what>'" in errs[0]


def test_tests_ref_to_missing_file_fails() -> None:
    errs = _errors(Tests="test/unit/test_no_such_file.py::test_x")
    assert len(errs) == 1
    assert "0042-test.patch: Tests:" in errs[0]
    assert "file test/unit/test_no_such_file.py does not exist" in errs[0]


def test_tests_ref_to_missing_test_name_fails() -> None:
    errs = _errors(Tests=f"{THIS}::test_server_logs_protections")
    assert len(errs) == 1
    assert "'test_server_logs_protections'" in errs[0] and THIS in errs[0]


def test_tests_ref_with_a_note_fails() -> None:
    errs = _errors(Tests="test/unit/test_patch_tooling.py (mooncake cases)")
    assert len(errs) == 1 and "is not a test reference" in errs[0]


def test_stray_comma_fails() -> None:
    assert any("empty reference" in e for e in _errors(Tests=f"{THIS},"))


class TestRefResolution:
    """``check_test_ref`` against a synthetic test file."""

    @pytest.fixture()
    def root(self, tmp_path: Path) -> Path:
        (tmp_path / "test" / "unit").mkdir(parents=True)
        (tmp_path / "test" / "unit" / "test_a.py").write_text(
            "import pytest\n\n"
            "def helper():\n    pass\n\n"
            "async def test_async():\n    pass\n\n"
            "class TestGroup:\n    def test_in_class(self):\n        pass\n\n"
            "    async def test_async_in_class(self):\n        pass\n\n"
            "def test_param(x):\n    def test_nested():\n        pass\n")
        return tmp_path

    @pytest.mark.parametrize("ref", [
        "test/unit/test_a.py", "test/unit/test_a.py::test_async",
        "test/unit/test_a.py::TestGroup", "test/unit/test_a.py::TestGroup::test_in_class",
        "test/unit/test_a.py::TestGroup::test_async_in_class",
        "test/unit/test_a.py::test_param[mooncake-1]",
    ])
    def test_resolving_refs(self, root: Path, ref: str) -> None:
        assert pp.check_test_ref(ref, root) is None

    @pytest.mark.parametrize("ref, why", [
        ("test/unit/test_a.py::test_nested", "no top-level def or class 'test_nested'"),
        ("test/unit/test_a.py::TestGroup::test_missing", "class TestGroup in test/unit/"
                                                         "test_a.py has no method 'test_missing'"),
        ("test/unit/test_a.py::test_async::x", "'test_async' in test/unit/test_a.py is not a "
                                               "class"),
        ("test/unit/test_b.py", "file test/unit/test_b.py does not exist"),
        ("../outside.py", "under test/"),
        ("test/unit/test_a.py::A::b::c", "at most Class::method"),
        ("test/unit/test_a.py[x]", "a parameter id needs a test name"),
        ("test/unit/test_a.py (all)", "is not a test reference"),
    ])
    def test_unresolved_refs(self, root: Path, ref: str, why: str) -> None:
        err = pp.check_test_ref(ref, root)
        assert err is not None and why in err

    def test_method_ref(self) -> None:  # named by the good header above (a real Class::method)
        assert pp.check_test_ref(f"{THIS}::TestRefResolution::test_method_ref", ROOT) is None


def test_module_names_of_touched_files() -> None:
    assert pp.module_name("python/sglang/srt/disaggregation/decode.py") == \
        "sglang.srt.disaggregation.decode"
    assert pp.module_name("python/sglang/srt/__init__.py") == "sglang.srt"
    assert pp.module_name("python/sglang/srt/data.json") is None


def _write_series(d: Path, patches: dict[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in patches.items():
        (d / name).write_text(text)
    (d / "series").write_text("# test series\n" + "\n".join(patches) + "\n")


def test_cli_names_the_patch_and_the_bad_reference(tmp_path: Path) -> None:
    bad = _patch(Tests=f"{THIS}::test_does_not_exist")
    _write_series(tmp_path / "p", {"0001-good.patch": _patch(), "0002-bad.patch": bad})
    proc = subprocess.run([sys.executable, str(SCRIPT), "check", "--headers-only", "--patches",
                           str(tmp_path / "p")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "0002-bad.patch: Tests:" in proc.stderr and "'test_does_not_exist'" in proc.stderr
    assert "0001-good.patch" not in proc.stderr

    _write_series(tmp_path / "q", {"0001-good.patch": _patch()})
    proc = subprocess.run([sys.executable, str(SCRIPT), "check", "--headers-only", "--patches",
                           str(tmp_path / "q")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "headers ok (1 patches)" in proc.stdout


def _diff(rel: str, old: list[str], new: list[str]) -> str:
    body = "".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}", n=3))
    return f"diff --git a/{rel} b/{rel}\n{body}"


def test_revert_check_names_patches_that_share_hunk_context(tmp_path: Path) -> None:
    """0001 adds a line; 0002 adds one right under it (inside 0001's context): 0001 cannot be
    reverted alone without fuzz, and 0002 is named. 0003, far away, is independent."""
    rel = "python/sglang/mod.py"
    base = [f"line {i}\n" for i in range(40)]
    s1 = base[:10] + ["hook_a()\n"] + base[10:]
    s2 = s1[:11] + ["hook_b()\n"] + s1[11:]
    s3 = s2[:36] + ["hook_c()\n"] + s2[36:]
    patches = {"0001-a.patch": _diff(rel, base, s1), "0002-b.patch": _diff(rel, s1, s2),
               "0003-c.patch": _diff(rel, s2, s3)}
    _write_series(tmp_path / "p", patches)
    wheel = tmp_path / "base.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sglang/mod.py", "".join(base))
    tree = tmp_path / "tree"
    (tree / rel).parent.mkdir(parents=True)
    (tree / rel).write_text("".join(base))
    series = pp.pb.read_series(tmp_path / "p")
    for p in series:
        pp.pb.apply_patch(tree, p)
    assert (tree / rel).read_text() == "".join(s3)

    problems = pp.revert_conflicts(tree, wheel, series)
    assert len(problems) == 1, problems
    assert problems[0].startswith("0001-a.patch does not reverse-apply without fuzz")
    assert f"{rel}: hunk context changed by 0002" in problems[0]
    assert "0003" not in problems[0]
