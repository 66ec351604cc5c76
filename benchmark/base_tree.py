"""The ``base`` variant: pinned upstream 0.5.23 plus only the CPU-enablement patches 0001-0003.

Built from the same patch series as the fork, with the project's own tool::

    scripts/pdsafe-patches materialize build/bench-base-tree --force

which makes one git commit per patch on top of the pristine upstream wheel and our modules
commit; the tree is then reset to the commit of the last CPU-enablement patch (subject starting
with ``BASE_LAST_SUBJECT``). The ``sglang.pdsafe`` modules stay in the tree (they come with the
modules commit, below the patches): patch 0001 imports ``sglang.pdsafe.cpu_compat``, and no
later hook exists in the tree to call the others.

Servers of this variant run the tree's sources with ``PYTHONPATH=<tree>/python`` (see
``base_env``), so ``import sglang`` resolves to the tree instead of the installed fork.

Invariant: ``prepare_base_tree`` returns only a tree whose HEAD is the 0003 commit and whose
``sglang._version`` says the upstream version without a ``+pdsafe`` label; the harness also
checks every started base server's ``/server_info`` ``version`` (``targets.verify_variant``).
A tree is reused when its recorded input digest (patches 0001-0003, the modules they import,
the upstream lock) matches, so repeated runs do not re-materialize (~1 min).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TREE = REPO / "build" / "bench-base-tree"
#: Subject prefix of the last patch the base variant keeps (0003, NIXL host-memory registration).
BASE_LAST_SUBJECT = "disaggregation/nixl: register host-memory"
#: How many leading patches of patches/series the base keeps (the CPU-enablement ones).
BASE_PATCHES = 3
KEY_FILE = ".bench-base-key"
#: Our modules the base variant executes (patch 0001 calls sglang.pdsafe.cpu_compat.install()).
BASE_MODULES = ("sglang/pdsafe/__init__.py", "sglang/pdsafe/cpu_compat.py")


class BaseTreeError(RuntimeError):
    """The base tree could not be built or is not what the benchmark needs."""


@dataclass(frozen=True)
class BaseTree:
    """A materialized base tree: where it is, which commit, which version it reports."""

    path: Path
    commit: str
    subject: str
    version: str
    patches: tuple[str, ...]

    @property
    def python_path(self) -> Path:
        return self.path / "python"

    def env(self) -> dict[str, str]:
        """Extra environment of a base server: import sglang from the tree."""
        return base_env(self.path)

    def describe(self) -> dict[str, object]:
        return {"tree": str(self.path), "commit": self.commit, "head_subject": self.subject,
                "version": self.version, "patches": list(self.patches)}


def base_env(tree: Path) -> dict[str, str]:
    """``PYTHONPATH`` that makes a server import the base tree's sglang (ahead of site-packages)."""
    return {"PYTHONPATH": str(tree / "python")}


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=tree, check=True, capture_output=True,
                          text=True).stdout


def series_head(n: int = BASE_PATCHES, repo: Path = REPO) -> list[str]:
    """The first ``n`` patch file names of ``patches/series``."""
    names = [ln.strip() for ln in (repo / "patches" / "series").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    return names[:n]


def input_key(repo: Path = REPO) -> str:
    """Digest of what the base tree runs: patches 0001-0003, the modules they import, the lock."""
    h = hashlib.sha256()
    for name in series_head(repo=repo):
        h.update(name.encode())
        h.update((repo / "patches" / name).read_bytes())
    # Of our modules, the base runs only what patches 0001-0003 import (the others change
    # often and are inert without their hooks, so they do not invalidate a built tree).
    for rel in BASE_MODULES:
        p = repo / "python" / rel
        h.update(rel.encode())
        h.update(p.read_bytes() if p.is_file() else b"<absent>")
    h.update((repo / "upstream.lock").read_bytes())
    return h.hexdigest()


def tree_version(tree: Path) -> str:
    """``__version__`` as the tree's ``sglang/_version.py`` declares it (read, not imported)."""
    text = (tree / "python" / "sglang" / "_version.py").read_text()
    m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?(?:str\()?['"]([^'"]+)['"]""", text)
    if m is None:
        raise BaseTreeError(f"no __version__ in {tree}/python/sglang/_version.py")
    return m.group(1)


def find_commit(tree: Path, subject_prefix: str = BASE_LAST_SUBJECT) -> tuple[str, str]:
    """(sha, subject) of the tree's commit whose subject starts with ``subject_prefix``."""
    for line in _git(tree, "log", "--format=%H %s", "--all").splitlines():
        sha, _, subject = line.partition(" ")
        if subject.startswith(subject_prefix):
            return sha, subject
    raise BaseTreeError(f"{tree}: no commit whose subject starts with {subject_prefix!r}")


def _load(tree: Path, key: str) -> BaseTree | None:
    marker = tree / KEY_FILE
    if not marker.is_file():
        return None
    try:
        data = json.loads(marker.read_text())
        head = _git(tree, "rev-parse", "HEAD").strip()
    except (ValueError, subprocess.CalledProcessError):
        return None
    if data.get("key") != key or data.get("commit") != head:
        return None
    return BaseTree(tree, head, data["subject"], tree_version(tree), tuple(data["patches"]))


def prepare_base_tree(tree: Path = DEFAULT_TREE, *, force: bool = False,
                      log=print) -> BaseTree:
    """Materialize the series into ``tree`` and reset it to patch 0003's commit (cached)."""
    tree = tree.resolve()
    key = input_key()
    if not force:
        cached = _load(tree, key)
        if cached is not None:
            log(f"base tree: reusing {tree} at {cached.commit[:12]} ({cached.version})")
            _byte_compile(tree, log)
            return cached
    log(f"base tree: scripts/pdsafe-patches materialize {tree} --force (about a minute)")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "pdsafe-patches"), "materialize", str(tree),
         "--force"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BaseTreeError(f"materialize failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    sha, subject = find_commit(tree)
    _git(tree, "reset", "-q", "--hard", sha)
    # Patches above 0003 left no files behind after the hard reset; drop stale bytecode too.
    _git(tree, "clean", "-q", "-fdx", "-e", KEY_FILE)
    version = tree_version(tree)
    if "+pdsafe" in version:
        raise BaseTreeError(f"{tree} reports version {version}: not the pinned upstream")
    applied = _git(tree, "log", "--format=%s", "pdsafe-modules..HEAD").splitlines()[::-1]
    if len(applied) != BASE_PATCHES or not applied[-1].startswith(BASE_LAST_SUBJECT):
        raise BaseTreeError(f"{tree}: expected {BASE_PATCHES} patches above the modules commit "
                            f"ending with {BASE_LAST_SUBJECT!r}, found {applied}")
    if not (tree / "python" / "sglang" / "pdsafe" / "cpu_compat.py").is_file():
        raise BaseTreeError(f"{tree}: sglang.pdsafe.cpu_compat missing (patch 0001 needs it)")
    (tree / KEY_FILE).write_text(json.dumps(
        {"key": key, "commit": sha, "subject": subject, "patches": applied}, indent=1))
    log(f"base tree: {tree} at {sha[:12]} ({subject}); version {version}")
    _byte_compile(tree, log)
    return BaseTree(tree, sha, subject, version, tuple(applied))


COMPILED_MARKER = ".pdsafe-compiled"


def _byte_compile(tree: Path, log=print) -> None:
    """Byte-compile the tree's sources once. A server started with ``PYTHONDONTWRITEBYTECODE``
    (set on some machines, CI images included) would otherwise recompile all of sglang at every
    start (about 50 s per stock server on 2 cores); existing bytecode is still read."""
    import compileall

    marker = tree / COMPILED_MARKER
    if marker.is_file():
        return
    t0 = time.monotonic()
    ok = compileall.compile_dir(str(tree / "python"), quiet=1, workers=0)
    if ok:
        marker.write_text("1\n")
    log(f"base tree: byte-compiled in {time.monotonic() - t0:.0f} s" + ("" if ok else
        " (some files failed; servers compile them at start)"))
