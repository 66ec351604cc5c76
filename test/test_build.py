"""The build and the patch workflow: version label, CLI, hash pinning, broken patches, series."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# build_backend/ is on the path through pytest's `pythonpath` option (pyproject.toml).
import pdsafe_build as pb
import pytest

REPO = Path(__file__).resolve().parents[1]

PATCHES_TOOL = [sys.executable, str(REPO / "scripts" / "pdsafe-patches")]


@pytest.fixture(scope="module")
def upstream_wheel() -> Path:
    """The verified upstream wheel (from the build cache, downloaded if missing)."""
    return pb.fetch_upstream_wheel(pb.load_config(), pb.load_lock())


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


def test_installed_version_and_cli():
    import sglang

    cfg = pb.load_config()
    assert sglang.__version__ == cfg.version, sglang.__version__
    assert "+pdsafe." in importlib.metadata.version("sglang")
    info = __import__("sglang.pdsafe.version", fromlist=["build_info"]).build_info()
    assert info["upstream_sha256"] in pb.load_lock().values()
    assert info["patches"] == [p.name for p in pb.read_series(REPO / "patches")]
    r = _run([sys.executable, "-m", "sglang.launch_server", "--help"])
    assert r.returncode == 0 and "--disaggregation-mode" in r.stdout, r.stderr[-2000:]
    sglang_cli = Path(sys.executable).parent / "sglang"
    r = _run([str(sglang_cli), "serve", "--help"])
    assert r.returncode == 0 and "--model-path" in r.stdout + r.stderr, r.stderr[-2000:]


def test_dependencies_are_upstreams_unchanged(upstream_wheel: Path):
    """GPU users get exactly stock's dependency set: Requires-Dist is the upstream wheel's."""
    with zipfile.ZipFile(upstream_wheel) as zf:
        meta = zf.read(f"sglang-{pb.load_config().upstream_version}.dist-info/METADATA").decode()
    upstream = sorted(ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:"))
    ours = sorted(f"Requires-Dist: {r}" for r in importlib.metadata.requires("sglang"))
    assert ours == upstream


def test_hash_mismatch_is_a_hard_error_naming_both_hashes(tmp_path: Path, upstream_wheel: Path):
    fake = tmp_path / upstream_wheel.name
    shutil.copy(upstream_wheel, fake)
    with open(fake, "ab") as f:
        f.write(b"tampered")
    pins = pb.load_lock()
    with pytest.raises(pb.BuildError) as e:
        pb.verify_wheel(fake, pins)
    assert pins[fake.name] in str(e.value)
    assert pb.sha256_file(fake) in str(e.value)
    unpinned = tmp_path / "sglang-0.5.23-cp39-cp39-win_amd64.whl"
    unpinned.write_bytes(b"x")
    with pytest.raises(pb.BuildError, match="not pinned"):
        pb.verify_wheel(unpinned, pins)


def _copy_repo(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("pyproject.toml", "upstream.lock", "build_backend", "patches", "python"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dst / name)
    return dst


BROKEN = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] test: a patch whose context no longer matches

Why: proves that a stale patch fails the build loudly.
Upstream-Status: n/a
Tests: test/test_build.py
---
diff --git a/python/sglang/version.py b/python/sglang/version.py
--- a/python/sglang/version.py
+++ b/python/sglang/version.py
@@ -1,3 +1,3 @@
 try:
-    from sglang._version import __version__, __version_tuple__ as THIS_LINE_IS_NOT_UPSTREAM
+    from sglang._version import __version__, __version_tuple__
 except ImportError:
"""


def test_broken_patch_fails_the_build_with_its_name_and_hunk(tmp_path: Path,
                                                             upstream_wheel: Path):
    repo = _copy_repo(tmp_path / "repo")
    (repo / "patches" / "9999-broken.patch").write_text(BROKEN)
    with open(repo / "patches" / "series", "a") as f:
        f.write("9999-broken.patch\n")
    env = dict(os.environ, PDSAFE_UPSTREAM_WHEEL=str(upstream_wheel))
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
              "-w", str(tmp_path / "out"), str(repo)], env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "patch 9999-broken.patch does not apply" in out, out[-3000:]
    assert "failing hunk:" in out and "THIS_LINE_IS_NOT_UPSTREAM" in out, out[-3000:]
    assert not list((tmp_path / "out").glob("*.whl")) if (tmp_path / "out").exists() else True


def test_unlisted_patch_and_shadowing_module_fail(tmp_path: Path, upstream_wheel: Path):
    repo = _copy_repo(tmp_path / "repo")
    (repo / "patches" / "0999-stray.patch").write_text(BROKEN)
    with pytest.raises(pb.BuildError, match="not listed in patches/series"):
        pb.read_series(repo / "patches")
    tree = tmp_path / "tree"
    pb.unpack_wheel(upstream_wheel, tree)
    shadow = tmp_path / "py" / "sglang" / "version.py"
    shadow.parent.mkdir(parents=True)
    shadow.write_text("__version__ = 'evil'\n")
    with pytest.raises(pb.BuildError, match="would replace the upstream file"):
        pb.overlay_modules(tree, tmp_path / "py")


def test_our_modules_never_shadow_upstream_files(upstream_wheel: Path):
    with zipfile.ZipFile(upstream_wheel) as zf:
        upstream = set(zf.namelist())
    ours = {p.relative_to(REPO / "python").as_posix()
            for p in (REPO / "python").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert ours and not (ours & upstream)


def test_series_check_passes_on_pinned_base():
    r = _run([*PATCHES_TOOL, "check"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "series ok on" in r.stdout and "revert-clean" in r.stdout


def test_materialize_and_mailbox_round_trip(tmp_path: Path):
    """materialize gives base + modules + one commit per patch; the mailbox re-applies with
    git am on the pristine upstream base and yields the same tree."""
    tree = tmp_path / "tree"
    r = _run([*PATCHES_TOOL, "materialize", str(tree)])
    assert r.returncode == 0, r.stderr
    git = ["git", "-C", str(tree)]
    n_patches = len(pb.read_series(REPO / "patches"))
    log = _run([*git, "rev-list", "--count", "upstream-base..HEAD"]).stdout.strip()
    assert int(log) == n_patches + 1
    mbox = tmp_path / "series.mbox"
    r = _run([*PATCHES_TOOL, "mailbox", str(mbox)])
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@localhost")
    assert _run([*git, "checkout", "-q", "-b", "replay", "upstream-base"]).returncode == 0
    r = _run([*git, "am", "-q", str(mbox)], env=env)
    assert r.returncode == 0, r.stderr
    diff = _run([*git, "diff", "--stat", "pdsafe", "replay"])
    assert diff.returncode == 0 and diff.stdout.strip() == "", diff.stdout
