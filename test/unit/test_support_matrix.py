"""The generated support matrix (``sglang.pdsafe.support_matrix``, docs/kv-support.md; issue 20
item 8): the page is what the code renders, and each derived fact is checked against the real
upstream class or startup check it stands for, so the matrix cannot claim a protection the code
does not run (or hide a refusal it makes).

What it does not show: that a covered check holds (each protection's own tests), or that MORI or
Ascend ran here (they cannot: their KV managers are checked as classes).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang.pdsafe import kv_layouts, startup, support_matrix, transfer_generation

REPO = Path(__file__).resolve().parents[2]


def _manager(backend: str) -> type:
    if backend == "mori":
        from pdsafe_testkit.backends import import_mori_manager

        return import_mori_manager()
    module, name = support_matrix.MANAGERS[backend].split(":")
    return getattr(importlib.import_module(f"sglang.srt.disaggregation.{module}"), name)


def test_the_page_is_what_the_code_renders():
    """The page, spliced by the script's own function (loaded in-process: no second
    interpreter importing sglang), is unchanged by a fresh render."""
    spec = importlib.util.spec_from_file_location("support_matrix_script",
                                                  REPO / "scripts" / "support-matrix.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = script.DOC.read_text()
    assert script.splice(page, support_matrix.render()) == page, (
        "docs/kv-support.md is not what the code renders: run scripts/support-matrix.py")


def test_every_upstream_transfer_backend_is_classified():
    from sglang.srt.disaggregation.utils import TransferBackend

    assert tuple(b.value for b in TransferBackend) == support_matrix.BACKENDS


@pytest.mark.parametrize("backend", [b for b in support_matrix.BACKENDS if b != "fake"])
def test_the_generation_column_is_what_each_kv_manager_does(backend):
    """``pdsafe_transfer_generation_wired`` on the backend's real KV manager class (patch 0025)
    is what the matrix's generation column derives from ``UNWIRED_BACKENDS``."""
    cls = _manager(backend)
    assert cls.pdsafe_transfer_generation_wired is support_matrix.generation_wired(backend)


@pytest.mark.parametrize("backend", support_matrix.BACKENDS)
def test_a_startup_refusal_in_the_matrix_is_a_real_one(backend, monkeypatch):
    """Every backend the matrix marks as not starting is refused by the real startup checks
    (and one it marks as starting is not), without the waivers."""
    monkeypatch.delenv(transfer_generation.ENV_WAIVE_UNWIRED, raising=False)
    monkeypatch.delenv(startup.ENV_WAIVE_FAKE, raising=False)
    args = SimpleNamespace(disaggregation_transfer_backend=backend, disaggregation_mode="decode")
    cells = support_matrix.backend_cells(backend)
    refused = all(c.state == support_matrix.REFUSED for c in cells.values())
    raised = []
    for check in (transfer_generation.check_backend, startup.check_fake_transfer):
        try:
            check(args)
        except Exception as e:  # noqa: BLE001 - any refusal counts; the message is checked
            raised.append(str(e))
    assert bool(raised) is refused, (backend, raised, cells)


def test_pool_families_partition_the_digest_table():
    """Every pool class of the digest's table belongs to exactly one hardware family, and the
    Ascend column is exactly the NPU classes (all refused today, as its digest cell says)."""
    fams = {b: set(support_matrix.pool_classes(b)) for b in support_matrix.BACKENDS}
    gpu = fams["mooncake"]
    assert fams["ascend"] and not fams["ascend"] & gpu
    assert fams["ascend"] | gpu == {k for k in kv_layouts.CLASSES
                                    if not k.startswith("hardware_backend.mlx.")}
    ascend_covered = {k for k in fams["ascend"] if kv_layouts.CLASSES[k] in kv_layouts.LAYOUTS}
    digest = support_matrix.backend_cells("ascend")["digest"]
    assert (digest.state == support_matrix.COVERED) is bool(ascend_covered), digest


def test_a_layout_the_digest_reads_is_covered_on_the_backends_that_build_it():
    for layout in kv_layouts.LAYOUTS:
        cells = support_matrix.layout_cells(layout)
        # MORI too since patch 0034 carries the transfer generation on its messages.
        assert cells["mooncake"].state == cells["nixl"].state == cells["mori"].state \
            == support_matrix.COVERED
