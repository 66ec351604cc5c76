"""The KV transfer backends the harness and the tests run (the one definition of the list).

Both run on CPU over loopback (see ``loopback.transport_pins``); tests parametrize over this
tuple, and ``KVPair`` refuses any other backend.
"""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("mooncake", "nixl")


def import_mori_manager() -> type:
    """``MoriKVManager``, imported with stand-ins for the ``mori`` package (ROCm/RDMA only, not
    installable here): enough to run its pure-Python control and status paths in unit tests.
    The stand-ins are removed again afterwards; the imported module keeps its references."""
    import sys
    import types
    from unittest import mock

    names = ("mori", "mori.cpp", "mori.io")
    saved = {k: sys.modules.get(k) for k in names}
    root = types.ModuleType("mori")
    for sub in ("cpp", "io"):
        m = mock.MagicMock(name=f"mori.{sub}")
        setattr(root, sub, m)
        sys.modules[f"mori.{sub}"] = m
    sys.modules["mori"] = root
    try:
        from sglang.srt.disaggregation.mori.conn import MoriKVManager
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return MoriKVManager


#: Environment variable naming the backends of the CI-time-bound server tests (comma-separated);
#: ``all`` runs every one of ``BACKENDS``.
SECONDARY_BACKENDS_ENV = "PDSAFE_FULL_BACKENDS"


def ci_backends(env: str = SECONDARY_BACKENDS_ENV) -> tuple[str, ...]:
    """The backends a server test whose logic does not depend on the backend's wire format runs
    on: Mooncake by default (CI time on 2 cores), every backend with ``PDSAFE_FULL_BACKENDS=all``
    (or a comma-separated list). Wire-level tests (content, peer release, stock/fork mixed
    versions, the KV harness) always parametrize over ``BACKENDS`` instead; the fork/fork
    other-release tests use this list (the pairing refuses over HTTP, before any KV traffic)."""
    import os

    raw = os.environ.get(env, "").strip()
    if raw == "all":
        return BACKENDS
    chosen = tuple(b for b in raw.split(",") if b in BACKENDS)
    return chosen or ("mooncake",)
