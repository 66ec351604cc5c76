"""The product wheel carries no test fault injection (issue 7, finding 9).

Fault injection lives only in the test-only testkit plugin (``test/testkit``,
``pdsafe_testkit.faults``). This builds the product wheel from the repository exactly as a user
does (``pip wheel``, the in-tree backend: pinned upstream wheel + patches/ + python/sglang) and
scans every file in it for the fault's markers, and the wheel's entry points for the plugin.
"""

from __future__ import annotations

import configparser
import io
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Strings that only fault-injection code contains (the variable, the rid prefixes, the fault's
#: name, the old module and the plugin's entry point / package).
MARKERS = (
    b"SGLANG_PDSAFE_TEST_FAULTS",
    b"pdsafe-fault-",
    b"foreign_kv",
    b"LATE_ROOM_BASE",
    b"test_faults",
    b"pdsafe_testkit",
)
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "pdsafe_test_faults"


def fault_markers(wheel: Path) -> list[str]:
    """Every ``path: marker`` hit in ``wheel`` (file contents, file names, plugin entry points)."""
    hits = []
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            data = zf.read(name)
            hits += [f"{name}: {m.decode()}" for m in MARKERS if m in data or m in name.encode()]
            if name.endswith(".dist-info/entry_points.txt"):
                eps = configparser.ConfigParser(delimiters=("=",))
                eps.optionxform = str  # entry point names are case-sensitive
                eps.read_file(io.StringIO(data.decode()))
                if eps.has_section(PLUGIN_GROUP):
                    hits += [f"{name}: [{PLUGIN_GROUP}] {k} = {v}"
                             for k, v in eps.items(PLUGIN_GROUP)
                             if k == PLUGIN_NAME or "pdsafe" in v]
    return hits


@pytest.fixture(scope="module")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The product wheel, built from this checkout as `pip wheel` builds it (~20-60 s)."""
    out = tmp_path_factory.mktemp("product-wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(REPO)],
        capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    wheels = list(out.glob("sglang-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_product_wheel_contains_no_fault_injection(product_wheel: Path):
    with zipfile.ZipFile(product_wheel) as zf:
        names = set(zf.namelist())
        gate = zf.read("sglang/pdsafe/commit_gate.py").decode()
    # The scan covers the real product: our modules and the patched upstream files are there.
    assert "def admit_commit(transfer_queue" in gate
    assert "sglang/srt/disaggregation/decode.py" in names and len(names) > 1000
    assert fault_markers(product_wheel) == []


def test_marker_scan_finds_a_fault_module_and_a_plugin_entry_point(tmp_path: Path):
    """The scan itself can fail: a wheel like the old product (fault module on the commit
    path) or one that declares the fault plugin is reported."""
    bad = tmp_path / "sglang-0-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("sglang/pdsafe/commit_gate.py",
                    "from sglang.pdsafe import coverage, test_faults\n")
        zf.writestr("sglang/pdsafe/other.py", 'ENV = "SGLANG_PDSAFE_TEST_FAULTS"\n')
        zf.writestr("sglang-0.dist-info/entry_points.txt",
                    f"[console_scripts]\nsglang = sglang.cli.main:main\n\n"
                    f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = pdsafe.x:register\n")
    hits = fault_markers(bad)
    assert "sglang/pdsafe/commit_gate.py: test_faults" in hits
    assert "sglang/pdsafe/other.py: SGLANG_PDSAFE_TEST_FAULTS" in hits
    assert any(f"[{PLUGIN_GROUP}] {PLUGIN_NAME}" in h for h in hits), hits
