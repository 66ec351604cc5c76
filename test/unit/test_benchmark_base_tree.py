"""The benchmark's base-variant tree helpers (no server, no materialize): which commit is the
base, which version it reports, and when a built tree may be reused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmark import base_tree as bt


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def _tree(tmp_path: Path, version: str = "0.5.23") -> Path:
    tree = tmp_path / "tree"
    (tree / "python" / "sglang").mkdir(parents=True)
    (tree / "python" / "sglang" / "_version.py").write_text(
        f"__version__ = version = '{version}'\n__version_tuple__ = (0, 5, 23)\n")
    _git(tree, "init", "-q")
    _git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
         "-m", "upstream: wheel")
    for subject in ("cpu: tolerate CPU-only torch", bt.BASE_LAST_SUBJECT + " pools as DRAM",
                    "entrypoints/http_server: log the active pdsafe protections"):
        _git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
             "--allow-empty", "-m", subject)
    return tree


def test_find_commit_picks_patch_0003(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    sha, subject = bt.find_commit(tree)
    assert subject.startswith(bt.BASE_LAST_SUBJECT)
    assert _git(tree, "log", "-1", "--format=%s", sha).strip() == subject
    with pytest.raises(bt.BaseTreeError):
        bt.find_commit(tree, "no such subject")


def test_tree_version_reads_the_label(tmp_path: Path) -> None:
    assert bt.tree_version(_tree(tmp_path)) == "0.5.23"
    assert bt.tree_version(_tree(tmp_path / "f", "0.5.23+pdsafe.1")) == "0.5.23+pdsafe.1"


def test_cached_tree_reused_only_with_matching_key_and_head(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    head = _git(tree, "rev-parse", "HEAD").strip()
    (tree / bt.KEY_FILE).write_text(json.dumps(
        {"key": "k1", "commit": head, "subject": "s", "patches": ["a", "b", "c"]}))
    got = bt._load(tree, "k1")
    assert got is not None and got.commit == head and got.version == "0.5.23"
    assert got.env() == {"PYTHONPATH": str(tree / "python")}
    assert bt._load(tree, "k2") is None  # inputs changed
    _git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
         "-m", "moved")
    assert bt._load(tree, "k1") is None  # HEAD moved


def test_input_key_covers_the_first_three_patches() -> None:
    names = bt.series_head()
    assert len(names) == bt.BASE_PATCHES and names[0].startswith("0001-")
    assert bt.input_key() == bt.input_key()
