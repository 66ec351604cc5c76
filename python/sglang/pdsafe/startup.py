"""Startup, at every entry point: the hook-API self-check, the start refusals, the report.

Two hooks, so that no entry point starts a PD server without them:

* :func:`launching` runs in the launcher, at the top of ``Engine._launch_subprocesses``, which
  the HTTP server, the offline ``sglang.Engine`` and ``--use-ray`` (``RayEngine``) go through
  before any scheduler exists. It creates the server's state directory (shared with the
  schedulers it spawns: :mod:`sglang.pdsafe.policy`'s poison), runs the checks and logs the
  protection report.
* :func:`scheduler_starting` runs in every scheduler process (``Scheduler.__init__``), which
  every entry point has: the smg gRPC servicer (``--smg-grpc-mode``) launches its schedulers
  itself, without the launcher above, and ``--use-ray``'s schedulers are Ray actors. It runs
  the same checks, and logs the report itself when no launcher did: a PD scheduler without a
  state directory in its environment, or any scheduler behind an smg gRPC front end
  (:func:`sglang.pdsafe.client_guard.tokenizer_manager_in_front`).

The checks (PD mode only; a co-located server runs none of the PD hooks):

* the hook-API self-check (:func:`sglang.pdsafe.hook_api.self_check` over
  :data:`HOOK_MODULES`): upstream lacks a member a hook calls -> :class:`HookAPIError`;
* the fake transfer backend (``--disaggregation-transfer-backend fake``): every request
  without a ``bootstrap_host`` would decode over pages nobody wrote for it, with no coverage
  gate, no digest and no generation. Refused (:class:`FakeTransferRefusedError`) unless
  ``SGLANG_PDSAFE_WAIVE_FAKE_TRANSFER=1``; with the waiver the report says which checks are
  off. Every request a decode serves by a fake transfer (any backend: the server's own
  warmups, or the fake backend under the waiver) has its pages zeroed first and is counted
  (``fake_transfer_served_total``, :mod:`sglang.pdsafe.kv_integrity`): it decodes over zeros,
  never over another request's KV;
* settings that must parse (the poison threshold).

**The report** lists, for this server's role only, the protections that are active; a
protection of the other role is not listed (it does not apply here, it is not "off"). "OFF"
appears only for a protection the operator switched off, naming the setting they changed;
and a protection that leans on one switched off is reported as weaker, saying how.

Invariant: a PD server that serves traffic passed the self-check and the start refusals in
the process that schedules it, whatever its entry point.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from sglang.pdsafe import cpu_compat, hook_api, policy, protections
from sglang.pdsafe.protections import Protection, is_pd, pd_mode
from sglang.pdsafe.version import version_string

logger = logging.getLogger("sglang.pdsafe")

#: The modules whose hooks the patch series calls. Each registers its protections and hooks
#: and declares the upstream API it needs at import; the startup checks import them all.
HOOK_MODULES: tuple[str, ...] = (
    "sglang.pdsafe.admission",
    "sglang.pdsafe.client_guard",
    "sglang.pdsafe.placeholder_guard",
    "sglang.pdsafe.coverage",
    "sglang.pdsafe.commit_gate",
    "sglang.pdsafe.peer_release",
    "sglang.pdsafe.peer_release_wire",
    "sglang.pdsafe.peer_notifier",
    "sglang.pdsafe.limits",
    "sglang.pdsafe.pair_agreement",
    "sglang.pdsafe.room_guard",
    "sglang.pdsafe.bootstrap_auth",
    "sglang.pdsafe.quarantine",
    "sglang.pdsafe.operator_api",
    "sglang.pdsafe.write_fence",
    "sglang.pdsafe.peer_policy",
    "sglang.pdsafe.peer_capability",
    "sglang.pdsafe.kv_integrity",
    "sglang.pdsafe.source_lease",
    "sglang.pdsafe.page_generation",
    "sglang.pdsafe.transfer_generation",
    "sglang.pdsafe.unclaimed_rooms",
    "sglang.pdsafe.unsigned_abort",
    "sglang.pdsafe.control_mac",
    "sglang.pdsafe.sample_rooms",
    "sglang.pdsafe.startup",
)

ENV_WAIVE_FAKE = "SGLANG_PDSAFE_WAIVE_FAKE_TRANSFER"
#: What a PD server served by the fake transfer backend runs without (the report's list).
FAKE_TRANSFER_OFF = ("coverage-attestation", "kv-digest", "transfer-generation",
                     "page-generation", "decode-page-quarantine", "prefill-source-lease")


# cpu_compat runs while sglang itself is being imported (patch 0001), before the policy can
# be: it is declared from here.
policy.passthrough("cpu_compat.install",
                   why="import-time CPU shims (tolerate an absent sgl-kernel, CUDA-only "
                       "torchvision); a failure raises ImportError and the process does not "
                       "start")(cpu_compat.install)


class FakeTransferRefusedError(RuntimeError):
    """A PD server was asked to start with the fake transfer backend (no waiver)."""


policy.answers(hook_api.HookAPIError, FakeTransferRefusedError)


def _fake_transfer(server_args: Any) -> bool:
    return str(getattr(server_args, "disaggregation_transfer_backend", "") or "") == "fake"


def fake_transfer_waived() -> bool:
    return os.environ.get(ENV_WAIVE_FAKE, "").strip().lower() in ("1", "true", "on", "yes")


def check_fake_transfer(server_args: Any) -> None:
    """Refuse a PD server on the fake transfer backend unless the operator waived it."""
    if not _fake_transfer(server_args):
        return
    if not fake_transfer_waived():
        raise FakeTransferRefusedError(
            f"sglang-pdsafe: this {pd_mode(server_args)} server was started with "
            "--disaggregation-transfer-backend fake: no KV is transferred, and a decode serves "
            "every request without a bootstrap_host over KV pages nobody wrote for it (another "
            "request's KV), with no coverage check, no KV digest and no transfer generation. "
            "It refuses to start. Use a real transfer backend (mooncake, nixl, mori); for a "
            f"benchmark without transfers only, set {ENV_WAIVE_FAKE}=1 (its requests then "
            "decode over zeroed pages, counted in sglang:pdsafe_fake_transfer_served_total).")
    logger.warning(
        "pdsafe: %s=1: this %s server runs on the fake transfer backend. Requests without a "
        "bootstrap_host move no KV: a decode zeroes their pages and decodes over zeros "
        "(meaningless answers); these checks are OFF for them: %s. Never serve tenants this "
        "way.", ENV_WAIVE_FAKE,
        pd_mode(server_args), ", ".join(FAKE_TRANSFER_OFF))


@policy.hook("startup.launching", outcome=policy.Outcome.POISON,
             counter="startup_failed_total", on_failure=policy.reraise_at_startup,
             effect="the server refuses to start")
def launching(server_args: Any) -> dict[str, bool]:
    """Launcher side (``Engine._launch_subprocesses``, before any scheduler): state
    directory, checks, report. Raises (the server does not start) when a check fails."""
    if is_pd(server_args) and policy.state_dir() is None:
        policy.create_state_dir()
    _checks(server_args)
    if is_pd(server_args):
        from sglang.pdsafe import control_mac

        control_mac.launcher_starting(server_args)  # this process's notices are signed
    if is_pd(server_args) and pd_mode(server_args) == "prefill":
        from sglang.pdsafe import bootstrap_auth

        # Before any scheduler exists: they inherit the key from this process.
        logger.info("pdsafe: bootstrap writes need the key from %s",
                    bootstrap_auth.prepare(server_args))
    if is_pd(server_args) and pd_mode(server_args) == "decode":
        from sglang.pdsafe import generation_key

        # Before any scheduler exists: its ranks inherit one key and mint alike.
        logger.info("pdsafe: transfer generations are keyed by %s",
                    generation_key.prepare(server_args))
    return report(server_args)


@policy.hook("startup.scheduler_starting", outcome=policy.Outcome.POISON,
             counter="startup_failed_total", on_failure=policy.reraise_at_startup,
             effect="the scheduler refuses to start (the server does not come up)")
def scheduler_starting(server_args: Any) -> None:
    """Scheduler side (``Scheduler.__init__``, every entry point): the same checks; the
    report too when no launcher ran :func:`launching` (smg gRPC; ``--use-ray`` actors that
    did not inherit the launcher's state directory)."""
    _checks(server_args, in_scheduler=True)
    if is_pd(server_args) and pd_mode(server_args) == "prefill":
        from sglang.pdsafe import bootstrap_auth

        bootstrap_auth.rank_starting(server_args)
    if is_pd(server_args) and pd_mode(server_args) == "decode":
        from sglang.pdsafe import generation_key

        generation_key.rank_starting(server_args)
    if is_pd(server_args):
        from sglang.pdsafe import control_mac

        control_mac.rank_starting(server_args)  # unsigned: a warning, or refused if required
    from sglang.pdsafe import client_guard

    if policy.state_dir() is None and (
            is_pd(server_args) or not client_guard.tokenizer_manager_in_front(server_args)):
        report(server_args)


def _checks(server_args: Any, *, in_scheduler: bool = False) -> None:
    for name in HOOK_MODULES:  # registers every protection and hook, and their API needs
        importlib.import_module(name)
    hook_api.self_check(server_args, modules=HOOK_MODULES)
    if is_pd(server_args):
        check_fake_transfer(server_args)
        from sglang.pdsafe import transfer_generation

        # A backend without the generation does not start; the scheduler also reads its
        # manager class (it imports it anyway; the launcher must not, before it forks).
        transfer_generation.check_backend(server_args, read_class=in_scheduler)
        if pd_mode(server_args) == "prefill":
            from sglang.pdsafe import unclaimed_rooms

            unclaimed_rooms.check_settings()  # a malformed timeout or limit refuses the start
            from sglang.pdsafe import unsigned_abort

            unsigned_abort.check_settings()  # a malformed grace refuses the start
        policy.poison_after()  # a malformed threshold refuses the start


def report(server_args: Any) -> dict[str, bool]:
    """Log the protections that guard this server's role; warn for each one an operator
    switched off (naming the setting) and each one weakened by that. Returns the status."""
    role = pd_mode(server_args)
    st = protections.status(server_args)
    on = [n for n, active in st.items() if active]
    logger.info("%s: %s protections active: %s", version_string(),
                role if role != "null" else "co-located server", ", ".join(on) or "none")
    by_name: dict[str, Protection] = {p.name: p for p in protections.registered()}
    for name, active in st.items():
        p = by_name[name]
        if not active:
            logger.warning("pdsafe protection %r is OFF (%s, set by the operator). It guards: "
                           "%s.", p.name, p.switched_off(server_args), p.guards)
            continue
        for dep in p.leans_on:
            q = by_name.get(dep)
            setting = q.switched_off(server_args) if q is not None else None
            if setting is not None:
                logger.warning("pdsafe protection %r is weaker: %r is off (%s): %s.", p.name,
                               dep, setting, p.weaker_without)
    if is_pd(server_args) and _fake_transfer(server_args):
        for name in FAKE_TRANSFER_OFF:
            st[name] = False
    return st
