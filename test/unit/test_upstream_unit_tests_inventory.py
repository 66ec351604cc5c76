"""scripts/upstream_unit_tests.py's inventory: which upstream test files the stock-vs-fork
comparison runs (docs/upstream-unit-tests.md, issue 22 item 4: "every upstream unit-test file
for disaggregation that upstream registers for CPU, not a subset").

A file runs when upstream's own CI registration parser (``sglang.test.ci.ci_register``, loaded
from the tree under test) finds an enabled CPU registration in it and every ``sglang`` module
and name it imports exists in the tree; every other file is listed with the reason.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import upstream_unit_tests as uut  # noqa: E402  (a script, not a package)


def _tree(root: Path) -> Path:
    import sglang.test.ci.ci_register as ci

    tree = root / "tree"
    (tree / "python" / "sglang" / "test" / "ci").mkdir(parents=True)
    shutil.copy(ci.__file__, tree / "python" / "sglang" / "test" / "ci" / "ci_register.py")
    pkg = tree / "python" / "sglang" / "srt" / "disaggregation"  # a namespace package
    pkg.mkdir(parents=True)
    (pkg / "conn.py").write_text("class KVPoll:\n    pass\n\n\ndef helper():\n    pass\n")
    return tree


HEAD = "from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci\n"


def _tests(root: Path) -> Path:
    d = root / "tests"
    d.mkdir()
    files = {
        "test_ok.py": HEAD + "from sglang.srt.disaggregation.conn import KVPoll\n"
                             "from sglang.srt.disaggregation import conn\n"
                             "register_cpu_ci(est_time=3, suite='base-a-test-cpu')\n",
        "test_gpu_only.py": HEAD + "register_cuda_ci(est_time=3, suite='stage-b-test-1-gpu')\n",
        "test_newer_api.py": HEAD + "from sglang.srt.disaggregation.conn import AckTarget\n"
                                    "import sglang.srt.disaggregation.destination_ready\n"
                                    "register_cpu_ci(est_time=3, suite='base-a-test-cpu')\n",
        "test_disabled.py": HEAD + "register_cpu_ci(est_time=3, suite='base-a-test-cpu', "
                                   "disabled='flaky')\n",
        "helper_not_a_test.py": "x = 1\n",
    }
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_inventory_runs_only_cpu_registered_importable_files(tmp_path):
    rows = {r["file"]: r for r in uut.inventory(_tests(tmp_path), _tree(tmp_path))}
    assert set(rows) == {"test_ok.py", "test_gpu_only.py", "test_newer_api.py",
                         "test_disabled.py"}
    assert rows["test_ok.py"]["run"] and rows["test_ok.py"]["suites"] == ["base-a-test-cpu"]
    assert not rows["test_gpu_only.py"]["cpu"]
    assert rows["test_gpu_only.py"]["other_backends"] == ["CUDA"]
    assert rows["test_newer_api.py"]["cpu_enabled"] and not rows["test_newer_api.py"]["run"]
    assert rows["test_newer_api.py"]["missing_imports"] == [
        "sglang.srt.disaggregation.conn.AckTarget",
        "sglang.srt.disaggregation.destination_ready"]
    assert rows["test_disabled.py"]["cpu"] and not rows["test_disabled.py"]["cpu_enabled"]
    table = uut.render_inventory(list(rows.values()))
    assert table.startswith("1 of 4 files run") and "`test_newer_api.py`" in table
