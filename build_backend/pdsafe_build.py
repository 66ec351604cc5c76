"""PEP 517 backend that assembles sglang-pdsafe from the pinned upstream wheel.

Build = verified upstream wheel  ->  patches/ applied in ``patches/series`` order
        ->  our new modules from ``python/sglang/`` added  ->  version stamped
        ``<upstream>+pdsafe.<N>``  ->  wheel with the upstream's tags, metadata and dependencies.

Invariants this module keeps:

* Nothing is built from an upstream wheel whose sha256 is not pinned in ``upstream.lock``;
  a mismatch is a hard error that names both hashes.
* A patch that does not apply fails the build, naming the patch and the failing hunk; no
  partially patched tree is ever packed.
* Our modules never overwrite an upstream file: upstream files change only through patches/.
* Dependencies are the upstream wheel's, unchanged (stock users get stock's dependency set).

Environment / config settings:

* ``PDSAFE_UPSTREAM_WHEEL`` (or ``--config-settings upstream-wheel=PATH``): use this local wheel
  file instead of downloading (offline builds). It is still verified against ``upstream.lock``.
* ``PDSAFE_WHEEL_CACHE``: where downloaded upstream wheels are kept
  (default ``~/.cache/sglang-pdsafe/wheels``).

The functions below are also used by ``scripts/`` (materialize, check-series, export).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parent.parent


class BuildError(RuntimeError):
    """A build step failed; the message says what and what to do."""


@dataclass(frozen=True)
class ForkConfig:
    """The pinned base and the fork's release number, read from pyproject.toml."""

    name: str
    upstream_version: str
    release: int

    @property
    def version(self) -> str:
        """PEP 440 version with a local label, so ``sglang==0.5.23`` pins accept it."""
        return f"{self.upstream_version}+pdsafe.{self.release}"


def load_config(root: Path = REPO_ROOT) -> ForkConfig:
    """Read ``[tool.pdsafe]`` from pyproject.toml."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    tool = data["tool"]["pdsafe"]
    return ForkConfig(
        name=tool["upstream-name"],
        upstream_version=tool["upstream-version"],
        release=int(tool["pdsafe-release"]),
    )


def load_lock(root: Path = REPO_ROOT) -> dict[str, str]:
    """Map wheel file name -> pinned sha256 from ``upstream.lock``."""
    pins: dict[str, str] = {}
    for line in (root / "upstream.lock").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fname, digest = line.split()
        pins[fname] = digest.lower()
    return pins


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_wheel(path: Path, pins: dict[str, str]) -> str:
    """Return the wheel's sha256 if it is pinned and matches; raise BuildError otherwise."""
    if path.name not in pins:
        raise BuildError(
            f"upstream wheel {path.name} is not pinned in upstream.lock; pinned wheels: "
            f"{', '.join(sorted(pins))}. Pin it (after checking its origin) or build on a "
            "supported interpreter/platform."
        )
    actual = sha256_file(path)
    expected = pins[path.name]
    if actual != expected:
        raise BuildError(
            f"sha256 mismatch for upstream wheel {path}: expected {expected} (upstream.lock), "
            f"got {actual}. The file is not the pinned upstream release; delete it and rebuild, "
            "or investigate where it came from."
        )
    return actual


def _config_value(config_settings: dict | None, key: str, env: str) -> str | None:
    if config_settings and config_settings.get(key):
        return str(config_settings[key])
    return os.environ.get(env) or None


def fetch_upstream_wheel(
    cfg: ForkConfig, pins: dict[str, str], config_settings: dict | None = None
) -> Path:
    """Return a verified upstream wheel for the running interpreter/platform.

    Uses ``PDSAFE_UPSTREAM_WHEEL`` when set, else the cache, else ``pip download`` by exact
    version (``--only-binary``, ``--no-deps``) through the user's configured package index.
    """
    local = _config_value(config_settings, "upstream-wheel", "PDSAFE_UPSTREAM_WHEEL")
    if local:
        path = Path(local).expanduser().resolve()
        if not path.is_file():
            raise BuildError(f"PDSAFE_UPSTREAM_WHEEL={local} does not exist")
        verify_wheel(path, pins)
        return path
    cache = Path(
        _config_value(config_settings, "wheel-cache", "PDSAFE_WHEEL_CACHE")
        or Path.home() / ".cache" / "sglang-pdsafe" / "wheels"
    ).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    for name in _compatible_pins(cfg, pins):
        cached = cache / name
        if cached.is_file() and sha256_file(cached) == pins[name]:
            return cached
    with tempfile.TemporaryDirectory(prefix="pdsafe-dl-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-d", tmp, f"{cfg.name}=={cfg.upstream_version}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(
                f"could not download {cfg.name}=={cfg.upstream_version}:\n{proc.stderr[-2000:]}\n"
                "Offline? Point PDSAFE_UPSTREAM_WHEEL at a local copy of the pinned wheel."
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise BuildError(f"expected one wheel from pip download, got {wheels}")
        verify_wheel(wheels[0], pins)
        dest = cache / wheels[0].name
        shutil.copy2(wheels[0], dest)
    verify_wheel(dest, pins)
    return dest


def _compatible_pins(cfg: ForkConfig, pins: dict[str, str]) -> list[str]:
    """Pinned wheel names installable on this interpreter, best tag first."""
    try:
        from packaging.tags import sys_tags
    except ImportError:
        from pip._vendor.packaging.tags import sys_tags
    prefix = f"{cfg.name}-{cfg.upstream_version}-"
    by_tag = {name[len(prefix):-len(".whl")]: name for name in pins if name.startswith(prefix)}
    out = []
    for tag in sys_tags():
        name = by_tag.get(str(tag))
        if name and name not in out:
            out.append(name)
    return out


# --------------------------------------------------------------------------- patches


def read_series(patches_dir: Path) -> list[Path]:
    """Patches in ``patches/series`` order; every listed file must exist, none may be unlisted."""
    series = patches_dir / "series"
    names = [
        ln.strip()
        for ln in series.read_text().splitlines()
        if ln.strip() and not ln.lstrip().startswith("#")
    ]
    missing = [n for n in names if not (patches_dir / n).is_file()]
    if missing:
        raise BuildError(f"patches/series lists missing patch files: {missing}")
    unlisted = sorted(
        p.name for p in patches_dir.glob("*.patch") if p.name not in set(names)
    )
    if unlisted:
        raise BuildError(
            f"patch files not listed in patches/series: {unlisted}. Add them to the series "
            "(in order) or delete them."
        )
    return [patches_dir / n for n in names]


_FAILED_RE = re.compile(r"patch failed: (?P<file>\S+):(?P<line>\d+)")


def failing_hunk(patch: Path, git_stderr: str) -> str:
    """Extract the hunk git reported as failing (file and old-start line) from a patch."""
    m = _FAILED_RE.search(git_stderr)
    if not m:
        return ""
    target, line = m.group("file"), int(m.group("line"))
    current: str | None = None
    hunks: list[str] = []
    buf: list[str] | None = None
    for raw in patch.read_text(errors="replace").splitlines():
        if raw.startswith("diff --git "):
            current = raw.split(" b/", 1)[-1]
            buf = None
            continue
        if raw.startswith("@@"):
            hm = re.match(r"@@ -(\d+)", raw)
            if buf is not None:
                hunks.append("\n".join(buf))
            buf = [raw] if current == target and hm and int(hm.group(1)) == line else None
            if buf is None and hunks:
                break
            continue
        if buf is not None:
            if raw.startswith(("diff --git", "--", "-- ")) and raw.strip() == "--":
                break
            buf.append(raw)
    if buf is not None:
        hunks.append("\n".join(buf))
    return hunks[0] if hunks else ""


def _git_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # Never let git discover an enclosing repository: paths are relative to ``tree``.
    env["GIT_CEILING_DIRECTORIES"] = str(tree.parent)
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return env


def apply_patch(tree: Path, patch: Path) -> None:
    """Apply one git-format patch (paths ``a/python/sglang/...``) to an upstream tree.

    ``tree`` is the directory that contains ``python/sglang``. Raises BuildError naming the
    patch and the failing hunk; the tree is left untouched on failure (``git apply`` is atomic).
    """
    proc = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-p1", str(patch)],
        cwd=tree, env=_git_env(tree), capture_output=True, text=True,
    )
    if proc.returncode != 0:
        hunk = failing_hunk(patch, proc.stderr)
        raise BuildError(
            f"patch {patch.name} does not apply to the pinned base:\n{proc.stderr.strip()}\n"
            + (f"failing hunk:\n{hunk}\n" if hunk else "")
            + "Rebase it with scripts/pdsafe-patches materialize / export (see CONTRIBUTING.md)."
        )


def apply_series(tree: Path, patches_dir: Path) -> list[str]:
    """Apply every patch of the series in order; return their names."""
    applied = []
    for patch in read_series(patches_dir):
        apply_patch(tree, patch)
        applied.append(patch.name)
    return applied


# --------------------------------------------------------------------------- tree assembly


def unpack_wheel(wheel: Path, tree: Path) -> None:
    """Unpack an upstream wheel so that the package lives at ``tree/python/sglang``."""
    (tree / "python").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tree / "python")
        for info in zf.infolist():  # keep the executable bit of shipped scripts/extensions
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(tree / "python" / info.filename, mode)


def overlay_modules(tree: Path, src: Path = REPO_ROOT / "python") -> list[str]:
    """Copy our new modules into the tree. Refuses to replace any upstream file."""
    added = []
    for path in sorted(src.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        rel = path.relative_to(src)
        dest = tree / "python" / rel
        if dest.exists():
            raise BuildError(
                f"python/{rel} would replace the upstream file of the same name. Upstream files "
                "change only through patches/; put our logic in a new module and hook it in "
                "with a patch."
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
        added.append(str(rel))
    return added


def prepare_tree(
    tree: Path,
    config_settings: dict | None = None,
    *,
    patches_dir: Path = REPO_ROOT / "patches",
    with_modules: bool = True,
) -> dict:
    """Assemble the patched tree under ``tree``; return build info (what went in)."""
    cfg = load_config()
    pins = load_lock()
    wheel = fetch_upstream_wheel(cfg, pins, config_settings)
    unpack_wheel(wheel, tree)
    added = overlay_modules(tree) if with_modules else []
    applied = apply_series(tree, patches_dir)
    return {
        "version": cfg.version,
        "upstream_version": cfg.upstream_version,
        "upstream_wheel": wheel.name,
        "upstream_sha256": pins[wheel.name],
        "patches": applied,
        "modules": added,
    }


def _stamp(tree: Path, cfg: ForkConfig, info: dict) -> Path:
    """Stamp version into the generated ``_version.py`` and rename the dist-info.

    ``sglang/_version.py`` is generated at build time upstream too (setuptools-scm); we
    regenerate it the same way. Returns the new dist-info directory.
    """
    pkg = tree / "python" / "sglang"
    parts = cfg.upstream_version.split(".")
    vtuple = ", ".join([*(p for p in parts), f"'pdsafe{cfg.release}'"])
    (pkg / "_version.py").write_text(
        "# file generated by the sglang-pdsafe build (build_backend/pdsafe_build.py)\n"
        "# don't change, don't track in version control\n"
        f"__version__ = version = {cfg.version!r}\n"
        f"__version_tuple__ = version_tuple = ({vtuple})\n"
        "__commit_id__ = commit_id = None\n"
    )
    (pkg / "pdsafe" / "_build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    old = tree / "python" / f"{cfg.name}-{cfg.upstream_version}.dist-info"
    new = tree / "python" / f"{cfg.name}-{cfg.version}.dist-info"
    old.rename(new)
    meta = (new / "METADATA").read_text()
    meta, n = re.subn(r"(?m)^Version: .*$", f"Version: {cfg.version}", meta, count=1)
    if n != 1:
        raise BuildError("upstream METADATA has no Version field")
    (new / "METADATA").write_text(meta)
    (new / "RECORD").unlink()
    return new


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def pack_wheel(root: Path, dist_info: Path, out_dir: Path, wheel_name: str) -> str:
    """Zip ``root`` into ``out_dir/wheel_name`` with a fresh RECORD (RECORD last)."""
    record_rel = f"{dist_info.name}/RECORD"
    rows = []
    out = out_dir / wheel_name
    # compresslevel 1: the payload is mostly already-compressed .so files and source; level 1
    # packs within a few % of the default at a fraction of the time.
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        # dist-info last, as the wheel spec recommends.
        files.sort(key=lambda p: (p.is_relative_to(dist_info), str(p)))
        for p in files:
            rel = p.relative_to(root).as_posix()
            data = p.read_bytes()
            zi = zipfile.ZipInfo(rel, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = (p.stat().st_mode & 0o777 | 0o100000) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data, compresslevel=1)
            rows.append((rel, _record_hash(data), str(len(data))))
        rows.append((record_rel, "", ""))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        zi = zipfile.ZipInfo(record_rel, date_time=(2020, 1, 1, 0, 0, 0))
        zi.external_attr = 0o100644 << 16
        zf.writestr(zi, buf.getvalue())
    return out.name


def build_wheel_into(out_dir: Path, config_settings: dict | None = None) -> str:
    """Build the fork's wheel into ``out_dir``; return the file name."""
    cfg = load_config()
    with tempfile.TemporaryDirectory(prefix="pdsafe-build-") as tmp:
        tree = Path(tmp) / "tree"
        info = prepare_tree(tree, config_settings)
        dist_info = _stamp(tree, cfg, info)
        upstream_name = info["upstream_wheel"]
        tags = upstream_name[len(f"{cfg.name}-{cfg.upstream_version}-"):]
        wheel_name = f"{cfg.name}-{cfg.version}-{tags}"
        return pack_wheel(tree / "python", dist_info, Path(out_dir), wheel_name)


# --------------------------------------------------------------------------- PEP 517 hooks


def get_requires_for_build_wheel(config_settings=None):  # noqa: D103
    return []


def get_requires_for_build_sdist(config_settings=None):  # noqa: D103
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):  # noqa: D103
    try:
        return build_wheel_into(Path(wheel_directory), config_settings)
    except BuildError as e:
        # A short, clear message at the end of pip's output.
        sys.stderr.write(f"\nsglang-pdsafe build failed: {e}\n")
        raise


_SDIST_EXCLUDE = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", ".venv"}


def build_sdist(sdist_directory, config_settings=None):  # noqa: D103
    cfg = load_config()
    base = f"{cfg.name}-{cfg.version}"
    out = Path(sdist_directory) / f"{base}.tar.gz"
    with tarfile.open(out, "w:gz") as tf:
        for p in sorted(REPO_ROOT.rglob("*")):
            rel = p.relative_to(REPO_ROOT)
            if any(part in _SDIST_EXCLUDE for part in rel.parts) or p.is_dir():
                continue
            tf.add(p, arcname=f"{base}/{rel.as_posix()}")
    return out.name
