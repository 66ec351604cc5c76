"""MORI's control messages carry the transfer generation and the cluster MAC (patch 0034;
issue 20, item 4), shown by running the backend-parametrized tests of the Mooncake and NIXL
wiring on MORI's real classes.

Each case below is one test of ``test_transfer_generation``, ``test_abort_generation`` or
``test_control_mac`` (every test there that takes a ``backend``, with each of its other
parametrizations), called with ``backend="mori"``: MORI's real ``MoriKVManager`` /
``MoriKVReceiver`` / ``MoriKVSender`` (imported with stand-ins for the ``mori`` package, which
needs ROCm), its real bootstrap and decode control loops fed through a stand-in socket, its real
metadata builder and parser, its real TCP aux send and ``_handle_aux_data``, and its real ABORT
handler. The cases live here, not in those modules, so that the earlier prefixes of the patch
series (which do not wire MORI) do not run them: ``pdsafe-patches check --each-patch`` runs
this module at 0034.

What it does not show: a MORI transfer (its RDMA IO engine); the tests that are
Mooncake/NIXL-specific (staging's CHUNK_READY: MORI has no staging path) are not in the list.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from sglang.pdsafe import metrics, startup, transfer_generation

from . import test_abort_generation as tab
from . import test_control_mac as tcm
from . import test_transfer_generation as tgt
from .test_control_mac import _clean  # noqa: F401 - the same autouse environments
from .test_transfer_generation import _env, _mori_engine_desc  # noqa: F401

#: Tests of the backend-parametrized modules that do not apply to MORI (no staging path).
NOT_ON_MORI = {"test_a_stale_chunk_ready_never_reaches_the_staging_handler"}


def _backend_tests(module: ModuleType) -> list[tuple[str, Any]]:
    """(name, function) of every test of ``module`` that takes a ``backend`` and applies to
    MORI."""
    return [(name, fn) for name, fn in sorted(vars(module).items())
            if name.startswith("test_") and callable(fn) and name not in NOT_ON_MORI
            and "backend" in inspect.signature(fn).parameters]


def _cases(module: ModuleType) -> Iterator[Any]:
    """One pytest param per (test of ``module`` taking ``backend``, its other parameters)."""
    for name, fn in _backend_tests(module):
        axes: list[list[tuple[str, Any, str]]] = []
        for mark in getattr(fn, "pytestmark", []):
            if mark.name != "parametrize" or mark.args[0] == "backend":
                continue
            argname, values = mark.args[0], mark.args[1]
            ids = mark.kwargs.get("ids") or [str(v) for v in values]
            axes.append([(argname, v, i) for v, i in zip(values, ids, strict=True)])
        for combo in itertools.product(*axes):
            kwargs = {a: v for a, v, _ in combo}
            label = "-".join([module.__name__.rsplit(".", 1)[-1], name] + [i for _, _, i in combo])
            yield pytest.param(fn, kwargs, id=label)


CASES = [*_cases(tgt), *_cases(tab), *_cases(tcm)]


def test_every_backend_test_of_the_wiring_modules_is_run_here():
    """The list is not empty and names every backend-taking test but the excluded ones."""
    names = {p.values[0].__name__ for p in CASES}
    for module in (tgt, tab, tcm):
        for name, _ in _backend_tests(module):
            assert name in names, name
    assert len(CASES) >= 40


@pytest.mark.parametrize("fn,kwargs", CASES)
def test_on_mori(fn, kwargs, request) -> None:
    fixtures = {p: request.getfixturevalue(p) for p in inspect.signature(fn).parameters
                if p not in kwargs and p != "backend"}
    fn(backend="mori", **kwargs, **fixtures)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_pd_server_on_mori_starts_and_an_unwired_manager_class_is_refused(mode, monkeypatch):
    """The scheduler's startup check reads the installed manager class (upstream's
    ``get_kv_class``): MORI, wired by 0034, starts; a tree whose MORI manager is not wired (0034
    reverted) is refused from the class alone, without anyone listing the backend. The
    launcher's check does not import backend classes (a launcher that did broke its
    scheduler's start)."""
    from types import SimpleNamespace

    from pdsafe_testkit.backends import import_mori_manager

    monkeypatch.delenv(transfer_generation.ENV_WAIVE_UNWIRED, raising=False)
    mori = import_mori_manager()
    args = SimpleNamespace(disaggregation_mode=mode, disaggregation_transfer_backend="mori")
    assert "mori" not in transfer_generation.UNWIRED_BACKENDS
    transfer_generation.check_backend(args, read_class=True)
    assert metrics.value(transfer_generation.UNWIRED_GAUGE) == 0
    monkeypatch.setattr(mori, "pdsafe_transfer_generation_wired", False)
    with pytest.raises(transfer_generation.UnwiredGenerationError,
                       match="does not carry the transfer generation"):
        transfer_generation.check_backend(args, read_class=True)
    with pytest.raises(transfer_generation.UnwiredGenerationError):
        startup.scheduler_starting(args)  # the scheduler reads the class
    transfer_generation.check_backend(args)  # the launcher does not (it must not import it)
