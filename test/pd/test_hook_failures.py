"""Every pdsafe hook made to fail, in turn, on real PD stacks (issue 19, items 4 and 5).

The servers run the test-only ``hook_fail`` fault (``pdsafe_testkit.hook_fail``: any named
hook raises at its entry or after its body ran, through its real guard and failure policy),
controlled at runtime, so one stack per backend serves every case. Each case arms one hook,
runs the workload items that reach it (``pdsafe_testkit.hook_suite``: requests through the
router and to both legs, a client-chosen room shared by two requests, an over-long prompt, a
request rejected at intake, a page freed under a transfer, KV corrupted in flight, aborts on
either leg while the prefill's write is held, the info and health endpoints), disarms it,
sends a probe through the router and audits both schedulers' KV allocators. A case passes
only when:

* no answer is wrong content (the content oracle judges every generation);
* no client waited for a server timeout: every refusal is explicit (an HTTP error with a
  message) and arrives within ``ERROR_BOUND_S``, every strict leg is answered (item 4);
* no server died;
* no page was freed twice, is both free and in use, or owned twice, and the pool adds up
  (the allocator audit, after the case and whenever a scheduler went quiet during it);
* every injected failure was counted (the hook's counter moved) and the declared outcome
  happened (a POISON hook poisons its server; no other hook does).

A hook the workload never reaches is skipped ("not exercised"); hooks that run only at startup
(their failure refuses the start) are listed as covered by the unit tests
(``test/unit/test_policy.py``, ``test/unit/test_startup_report.py``). Mooncake runs both modes;
NIXL runs ``entry`` unless ``PDSAFE_FULL_BACKENDS=all``. By default (CI) only a sample runs
(``CI_SAMPLE``, entry mode); ``PDSAFE_HOOK_SUITE=all`` runs every hook. The results (every case
and the startup hooks) go to ``hook-failures.json`` in the log directory
(``PDSAFE_HOOK_FAIL_RESULTS`` to choose the path); ``scripts/hook-failure-table.py`` turns them into
``docs/failure-policy-suite.md``.

The suite can see the bugs the policy closed (the legacy tests, run last): with the old
outcome of ``room_guard.claim`` restored (an endpoint built for a room that could not be
claimed), requests sharing a room are admitted together and the checks report it; with the old
``page_generation.release_request`` (upstream's plain release when the hook fails), a page
freed under the transfer is freed again and the allocator audit reports the double free.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdsafe_testkit.backends import SECONDARY_BACKENDS_ENV
from pdsafe_testkit.hook_fail import MODES
from pdsafe_testkit.hook_suite import (
    ITEMS,
    NOT_REACHED_WHY,
    CaseResult,
    FaultStack,
    HookInfo,
    Workload,
    calibrate,
    catalog,
    run_case,
    select_items,
    write_results,
)

pytestmark = pytest.mark.server

HOOKS = catalog()
BY_NAME = {h.name: h for h in HOOKS}
STARTUP = [h for h in HOOKS if h.startup]
FULL = os.environ.get(SECONDARY_BACKENDS_ENV, "").strip() == "all"
#: Hooks whose declared failure leaves the server refusing until it is restarted, by design:
#: each case needs a fresh stack (about two minutes on 2 cores), so they run last and only in
#: the full matrix.
BREAKERS = {
    "page_generation.freed": "POISON; the generation table stays broken, so every later "
                             "transfer is refused until the server restarts",
}
#: NIXL first: the legacy tests (Mooncake) then reuse the stack that is still running.
ORDER = ("nixl", "mooncake") if FULL else ("mooncake",)
#: ``PDSAFE_HOOK_SUITE=all`` runs every runtime hook in both modes (about 146 cases, 25-35 min
#: on 2 cores for Mooncake alone); unset, CI's budget runs :data:`CI_SAMPLE` at the hook's
#: entry: the hooks whose old failure outcome was open (issue 19's list), one per protection.
EVERY_HOOK = os.environ.get("PDSAFE_HOOK_SUITE", "").strip() == "all" or FULL
CI_SAMPLE = (
    "room_guard.claim", "page_generation.prefill_success_refusal",
    "page_generation.release_request", "page_generation.note_source_chunk",
    "transfer_generation.mint", "transfer_generation.drops_stale_message",
    "source_lease.draining", "quarantine.ready", "quarantine.hold",
    "coverage.attest_prefill_hook", "kv_integrity.verify_batch",
    "peer_capability.refuses_transfer_info", "admission.check_input_length",
    "commit_gate.admit_commit", "control_mac.verified",
    # Found by the full suite on 2026-12-07 (each fixed; entry mode, Mooncake, about 15 s each):
    "admission.advertised_limits", "peer_release.on_metadata_complete", "source_lease.deferred",
)


def _cases() -> list[tuple[str, str, str]]:
    """Every runtime case, backend by backend; the breakers last (full matrix only). Without
    ``PDSAFE_HOOK_SUITE=all``: :data:`CI_SAMPLE`, entry mode, Mooncake."""
    unknown = set(CI_SAMPLE) - {h.name for h in HOOKS if not h.startup}
    assert not unknown, f"CI_SAMPLE names hooks no server declares: {sorted(unknown)}"
    out = []
    for b in ORDER:
        runtime = [h for h in HOOKS if not h.startup]
        if not EVERY_HOOK:
            out += [(b, h.name, "entry") for h in runtime if h.name in CI_SAMPLE]
            continue
        normal = [h for h in runtime if h.name not in BREAKERS]
        last = [h for h in runtime if h.name in BREAKERS] if FULL else []
        out += [(b, h.name, m) for h in normal + last for m in MODES]
    return out


CASES = _cases()


class Suite:
    """One running stack at a time (backend by backend), its calibration, every result."""

    def __init__(self, log_dir: Path, model_path: Path, oracle, path: Path) -> None:
        self.log_dir, self.model_path, self.oracle, self.path = log_dir, model_path, oracle, path
        self.stacks: dict[str, FaultStack] = {}
        self.workloads: dict[str, Workload] = {}
        self.reach: dict[str, dict[str, set[str]]] = {}
        self.results: list[CaseResult] = []

    def workload(self, backend: str) -> Workload:
        for other, fs in self.stacks.items():
            if other != backend and fs.stack is not None:
                fs.stop()
        fs = self.stacks.setdefault(backend, FaultStack(backend, self.log_dir,
                                                        self.model_path))
        if fs.stack is None:
            fs.start()
            w = self.workloads[backend] = Workload(fs, self.oracle, self.model_path)
            if backend not in self.reach:
                self.reach[backend] = calibrate(w)
        return self.workloads[backend]

    def stop(self) -> None:
        for fs in self.stacks.values():
            fs.stop()

    def record(self, res: CaseResult) -> None:
        """Keep ``res`` and rewrite the results file (a run cut short keeps what it did)."""
        self.results.append(res)
        self.write(self.path)

    def write(self, path: Path) -> None:
        write_results(path, self.results, {
            "startup_hooks": [h.__dict__ for h in STARTUP],
            "reach": {b: {i: sorted(hs) for i, hs in r.items()} for b, r in self.reach.items()},
            "items": {name: (fn.__doc__ or "").split("\n")[0] for name, fn in ITEMS.items()},
            "full": FULL, "backends": list(ORDER), "not_reached_why": NOT_REACHED_WHY,
            "breakers": BREAKERS if not FULL else {},
        })


@pytest.fixture(scope="module")
def suite(log_dir: Path, model_path: Path, oracle) -> Iterator[Suite]:
    path = Path(os.environ.get("PDSAFE_HOOK_FAIL_RESULTS") or log_dir / "hook-failures.json")
    s = Suite(log_dir, model_path, oracle, path)
    try:
        yield s
    finally:
        s.stop()
        s.write(path)
        print(f"\nhook-failure results: {path}")


def _explain(res: CaseResult) -> str:
    lines = [f"{res.backend} {res.hook} ({res.mode}, declared {res.outcome}): "
             f"{len(res.problems())} problems"] + [f"  - {p}" for p in res.problems()]
    if res.log_excerpt:
        lines += ["  server log:"] + [f"    {ln}" for ln in res.log_excerpt]
    return "\n".join(lines)


def test_the_suite_covers_every_hook_the_servers_declare(suite: Suite) -> None:
    """The case list (read from the source) is the table the running servers hold."""
    fs = suite.workload(ORDER[-1]).fs
    declared = set()
    for s in fs.statuses():
        declared |= set(s["hooks"])
    assert declared == set(BY_NAME), (
        f"only in the servers: {sorted(declared - set(BY_NAME))}; "
        f"only in the source scan: {sorted(set(BY_NAME) - declared)}")
    for s in fs.statuses():
        for name, (outcome, counter) in s["hooks"].items():
            assert (outcome, counter) == (BY_NAME[name].outcome, BY_NAME[name].counter), name


#: Open findings of the suite: a hook whose failure outcome is not yet closed end to end is
#: listed here with the reason, and its case is marked xfail (not strict: the waits are
#: timing-dependent on 2 cores) so that the rest of the suite gates CI; the case still runs,
#: records its problems in hook-failures.json and reports XPASS once fixed. Of the four the CI
#: run of 2026-12-02 found, ``page_generation.release_request`` is closed (the held row is
#: detached and accounted page by page) and the prefill-side refusals now reach the decode at
#: once (``transfer.fail_room`` answers the decode's metadata with Failed), except where noted.
#: Closed since: ``transfer_generation.mint`` (a receiver cleared twice dropped the status of
#: the room's next request; a second clear now leaves it alone, patch 0018) and
#: ``peer_capability.refuses_transfer_info`` (its Failed echoes the metadata's generation).
KNOWN_FINDINGS: dict[str, str] = {
    "control_mac.sealed": "a prefill that cannot sign a generation-tagged message (its "
                          "Success, aux data, and the room's Failed while signing keeps "
                          "failing) sends it unsigned; the keyed decode drops it and the "
                          "request's decode leg waits for its own timeout (no unsigned message "
                          "may tell it otherwise), through the router too: the router does not "
                          "cancel the decode leg when the prefill leg fails (every router and "
                          "direct item of the case waited, full run of 2026-12-07); not in the "
                          "CI sample",
    "control_mac.sealed_for_prefill": "the alias item's prefill leg waits 20 s: the decode "
                                      "fails the room at the first pairing message it cannot "
                                      "sign for a prefill address it had not paired with; no "
                                      "bootstrap info exists yet, so no ABORT goes out, and "
                                      "the messages that did go out unsigned are dropped "
                                      "there (as they must be: anyone could send them); not "
                                      "in the CI sample",
    "transfer_generation.generation_frames": "a prefill that cannot attach the decode's "
                                             "generation to its Success, aux data or Failed "
                                             "sends them untagged; the decode drops them (an "
                                             "untagged notice could be anyone's) and waits "
                                             "for its timeout, as the hook declares, "
                                             "through the router too (the "
                                             "RecursionError that poisoned the prefill here "
                                             "is closed: transfer.fail_room is not re-entered "
                                             "for a room it is failing); not in the CI sample",
    "transfer_generation.status_frames": "as transfer_generation.generation_frames, for the "
                                         "KV status messages; not in the CI sample",
}
#: Closed 2026-12-06: ``coverage.attest_prefill_hook`` and ``page_generation.note_source_chunk``
#: (the abort items' second request of the refused room waited 20 s on the decode: peer release
#: told each decode endpoint once per refused room, not once per reservation; it now keys the
#: answer by the reservation's transfer generation, test/unit/test_peer_release_backends.py).
#: Found 2026-12-07 in a run of every ``control_mac`` and ``transfer_generation`` hook (not in
#: the CI sample; the same failures on the tree of the previous stop): the two entries above
#: from ``transfer_generation.generation_frames`` down, and two closed since:
#: Closed 2026-12-07 (later): ``transfer_generation.note_metadata`` and
#: ``unclaimed_rooms.note_metadata`` (the note's refusal dropped the room's metadata while
#: upstream's bootstrap thread still read it: a KeyError that ended NIXL's bootstrap thread, and
#: the decode's refusal went out untagged; now the manager's named call returns False and
#: upstream skips the room, and the refusal carries the generation the decode sent:
#: test/unit/test_unclaimed_rooms.py).
#: Closed 2026-12-07: ``control_mac.verified`` (the direct item's prefill leg waited 20 s when
#: the decode's message for the room, dropped by the failing check, reached the prefill before
#: the request did:
#: ``transfer.fail_room`` found no state and recorded nothing; a prefill room failed before its
#: sender opens is now remembered and that sender fails at once; the fresh-clone CI of
#: 0c3fb6f, test/unit/test_peer_release_backends.py).
#: Found and closed 2026-12-07 (the full run of every hook in both modes on Mooncake, 168 cases,
#: docs/failure-policy-suite.md): ``page_generation.release_source`` (mid) killed the prefill
#: (upstream's strict idle check: "req_to_token_pool memory leak"): rows held for good were
#: keyed by ``id(req)``, which Python reuses once a request object is collected, so a later
#: hold replaced an earlier one and dropped that row from the accounting. The held-row table
#: now mints its keys (test/unit/test_page_generation.py).


def _param(case: tuple[str, str, str]) -> Any:
    why = KNOWN_FINDINGS.get(case[1])
    if why is None:
        return case
    return pytest.param(*case, marks=pytest.mark.xfail(reason=f"open finding: {why}",
                                                       strict=False))


@pytest.mark.parametrize("backend,hook,mode", [_param(c) for c in CASES])
def test_hook_failure(suite: Suite, backend: str, hook: str, mode: str) -> None:
    w = suite.workload(backend)
    items = select_items(suite.reach[backend], hook)
    info: HookInfo = BY_NAME[hook]
    if not items:
        suite.record(CaseResult(backend, hook, mode, info.outcome, info.counter, [], [],
                                note="not reached by any workload item"))
        pytest.skip(f"not exercised: no workload item reaches {hook}")
    res = run_case(w, info, mode, items)
    suite.record(res)
    if not res.reached:
        pytest.skip(f"not exercised: {hook} was not called while armed (items {items})")
    assert not res.problems(), _explain(res)


def test_legacy_room_claim_is_caught(suite: Suite) -> None:
    """With the room guard's old outcomes restored (a failed claim built the endpoint
    unclaimed, a failed door check admitted the request), a second request of a room whose
    first request's transfer succeeded but is not committed yet (the decode parks it, test
    fault ``park_commit``) is admitted: the suite must report it (the decode dies on the
    shared Success with upstream's "Unexpected poll case: 4", or a client is left waiting or
    gets a wrong answer). Three concurrent duplicates were not enough (CI of 2026-12-02: the
    window is narrow); the parked one makes it deterministic.

    Both outcomes are restored because the claim's alone no longer admits the duplicate: the
    room's one transfer record is opened by whichever hook reaches the request first (the
    transfer generation's mint, the page-generation snapshot), so the door refuses it with
    409 even when the claim failed. The door is the guard; with its old outcome the crash the
    claim's fail-closed outcome prevents is back (first shown 2026-12-06)."""
    w = suite.workload("mooncake")
    res = run_case(w, BY_NAME["room_guard.claim"], "entry", ["parked_duplicate"],
                   legacy=("room_guard.claim", "room_guard.door"),
                   also=("room_guard.door",))
    suite.record(res)
    assert res.reached, "the claim never failed: the demonstration proved nothing"
    assert res.problems(), ("the old claim outcome went unnoticed:\n" + _explain(res))
    print(_explain(res))


def test_legacy_release_double_free_is_caught(suite: Suite) -> None:
    """With ``page_generation.release_request``'s old outcome (upstream's plain release when
    the hook fails), the page ``free_reserved`` freed under the transfer is freed again: the
    allocator audit must report it."""
    w = suite.workload("mooncake")
    res = run_case(w, BY_NAME["page_generation.release_request"], "entry", ["moved"],
                   legacy=("page_generation.release_request",))
    suite.record(res)
    assert res.reached, "the release hook never failed: the demonstration proved nothing"
    audit = [p for p in res.problems() if p.startswith("allocator audit")]
    assert any("freed twice" in p or "both free and in use" in p for p in audit), (
        "the allocator audit missed the double free:\n" + _explain(res))
    print(_explain(res))
