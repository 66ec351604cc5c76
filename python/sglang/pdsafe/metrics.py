"""Prometheus counters for every pdsafe failure path, one specific name per failure class.

Counters are created lazily on first use, in whichever process increments them (HTTP server,
scheduler), after SGLang has set ``PROMETHEUS_MULTIPROC_DIR``; with ``--enable-metrics`` they
appear on the server's ``/metrics`` endpoint next to upstream's ``sglang:`` metrics. Without a
metrics registry they still count in-process (``value()``), so the logic never depends on
whether metrics are exported.

Invariant: each name below is incremented on exactly one class of failure, so an operator's
alert on a name means one thing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

PREFIX = "sglang:pdsafe_"

#: name -> help text. Add a name here before incrementing it anywhere.
COUNTERS: dict[str, str] = {
    # admission (issue #3)
    "rejected_over_capacity_http_total":
        "Requests rejected at the HTTP layer: prompt longer than max_req_input_len.",
    "coverage_mismatch_total":
        "Transfers refused at decode commit: prefill wrote a different token range than "
        "decode reserved (room, token count, page count or nonce differ).",
    "coverage_attestation_invalid_total":
        "Transfers refused at decode commit: the metadata row carried no valid coverage "
        "attestation (prefill without sglang-pdsafe or another version, or a corrupt row).",
    "rejected_spoofed_bootstrap_host_total":
        "Client requests rejected for carrying the server-internal fake bootstrap host.",
    "rejected_spoofed_rid_total":
        "Client requests rejected for carrying the server-internal health-check rid prefix.",
    "rejected_client_mm_hashes_total":
        "Client requests rejected for carrying mm_hashes (a client-chosen prefix-cache key).",
    "prefill_unclaimed_room_dropped_total":
        "Decode metadata a prefill dropped because no request of its bootstrap room reached "
        "that prefill in time (SGLANG_PDSAFE_UNCLAIMED_ROOM_TIMEOUT_S); the decode was told "
        "(HTTP 400). A steady rate means a client or router sends requests to decodes only.",
    "prefill_unclaimed_room_evicted_total":
        "Decode metadata a prefill dropped early because more rooms than "
        "SGLANG_PDSAFE_UNCLAIMED_ROOM_LIMIT were waiting for their request (a flood of "
        "metadata naming rooms nobody sends, or a misrouting router); the decode was told.",
    "unclaimed_rooms_failed_total":
        "Unclaimed-room hooks that failed (listing a room, its claim, or the sweep); a room "
        "that could not be listed failed at once, one that could not be unlisted is checked "
        "again at its deadline.",
    "unauthenticated_kv_status_dropped_total":
        "KV status messages a decode dropped: their MAC did not verify under the cluster key, "
        "or they carried a transfer generation unsigned (a prefill of this release signs).",
    "unauthenticated_aux_data_dropped_total":
        "TCP aux data messages a decode dropped: bad MAC, or a transfer generation unsigned.",
    "unauthenticated_chunk_ready_dropped_total":
        "Staging CHUNK_READY messages a decode dropped: bad MAC, or a generation unsigned.",
    "unauthenticated_announce_dropped_total":
        "Decode capability announcements a keyed prefill dropped: bad MAC or unsigned.",
    "unauthenticated_registration_dropped_total":
        "Decode KV-args registrations (page base addresses) a keyed prefill dropped: bad MAC "
        "or unsigned (a stock decode signs nothing: it is served only under the waiver).",
    "unauthenticated_transfer_info_dropped_total":
        "Decode transfer metadata (room, page ids) a keyed prefill dropped: bad MAC or "
        "unsigned; no KV is written for it and no room state changes.",
    "unauthenticated_other_dropped_total":
        "Other messages at a prefill's bootstrap socket dropped for a MAC that did not verify.",
    "unauthenticated_abort_dropped_total":
        "Decode ABORTs a keyed prefill dropped: bad MAC or unsigned; the room's transfer is "
        "not failed by it and no drain ACK is armed.",
    "unsigned_abort_honoured_total":
        "Unsigned ABORTs a keyed prefill acted on: no decode sent metadata for the room "
        "within SGLANG_PDSAFE_UNSIGNED_ABORT_GRACE_S (a decode of another release refusing "
        "this prefill at pairing); the room failed at once.",
    "unsigned_abort_failed_total":
        "Unsigned-ABORT hooks that failed (holding one, or the sweep); an ABORT that could not "
        "be held was dropped (its request ends at its waiting timeout).",
    "unauthenticated_bootstrap_dropped_total":
        "Deferred-bootstrap BOOTSTRAP messages a keyed prefill dropped: bad MAC or unsigned.",
    "unauthenticated_abort_ack_dropped_total":
        "ABORT_ACKs a keyed decode dropped: bad MAC, or unsigned for a room whose prefill "
        "signs; no deferred release is advanced by them.",
    "unauthenticated_staging_dropped_total":
        "Staging messages (WATERMARK, STAGING_REQ, STAGING_RSP) a keyed leg dropped: this "
        "release does not sign them and a keyed server runs no staging.",
    "replayed_transfer_info_dropped_total":
        "Signed decode metadata a prefill dropped because it names a generation the same "
        "decode endpoint already replaced for the room (a replay of an earlier reservation).",
    "control_mac_failed_total":
        "Signed-control-message hooks that failed (a MAC that could not be computed or "
        "checked); the message was dropped or went unsigned and its room failed (500).",
    "peer_notified_release_total":
        "Requests whose peer was told to release its reservation after a local rejection.",
    "peer_release_notify_failed_total":
        "PD rejections whose peer could not be told to release (prefill rank lookup or control "
        "send failed); that peer frees only at its own timeout.",
    "placeholder_blocked_total":
        "Aborted requests stopped before a KV sender/receiver was created for them.",
    # named hook API (issue #7)
    "hook_api_mismatch_total":
        "pdsafe hooks that found upstream in a different shape than this build's patches expect "
        "(missing method or attribute, changed signature, moved module); the hook did nothing "
        "and upstream's behaviour applied. Operator: the fork's patches and the installed "
        "upstream disagree; reinstall the fork wheel built from the matching release.",
    # liveness: pair agreement (issue #7, finding 14)
    "pair_setting_mismatch_total":
        "Prefills a decode refused to pair with because a setting both PD legs must share "
        "differs (page size, KV dtype/layout, context length, chat template, pdsafe wire "
        "version); counted once per prefill and mismatch, logged with both values.",
    "pair_agreement_failed_total":
        "Pair-agreement hooks that failed (publishing, comparing or refusing raised); "
        "upstream's pairing behaviour applied.",
    # bootstrap writes need a key (issue 21, item 3)
    "bootstrap_unauthorized_total":
        "Writes to a prefill's bootstrap server (PUT /route, POST /register_dp_rank) refused "
        "with 401: no key or a key the server does not accept (an attempt to re-point a "
        "prefill rank's registration, or a prefill node configured with another key).",
    "bootstrap_stale_write_total":
        "Signed writes to a prefill's bootstrap server refused with 401 because their "
        "signature was valid but they were too old, dated in the future, or replayed (a "
        "captured registration sent again, or clocks between prefill nodes apart by more "
        "than the freshness window).",
    "bootstrap_auth_failed_total":
        "Bootstrap-key hooks that failed (a write check or a rank's key lookup raised); the "
        "write was refused.",
    # client-chosen bootstrap rooms (issue #9, item 1)
    "room_duplicate_refused_total":
        "PD requests refused (HTTP 409) at a scheduler door because their bootstrap_room is "
        "live on this server (another request in flight holds it); nothing was reserved and "
        "the peer was not told (that would fail the live request).",
    "room_parallel_sampling_refused_total":
        "PD requests with n>1 (parallel sampling) refused (HTTP 400) at the HTTP layer: every "
        "sample would share the request's bootstrap room.",
    "room_guard_failed_total":
        "Room-guard hooks that failed (door check, claim or release raised). A failed door "
        "check refuses the request (503, fail closed); a failed claim or release leaves the "
        "room unguarded or live until its next release.",
    # decode-page quarantine (issue #9, item 4)
    "quarantine_released_ack_total":
        "Quarantined decode transfers released on a drain ACK from every prefill writer rank.",
    "quarantine_released_incarnation_total":
        "Quarantined decode transfers released because their prefill writer registered again "
        "with a new process incarnation (the process the destinations went to has exited).",
    "quarantine_released_operator_total":
        "Quarantined decode transfers released by an operator's POST "
        "/pdsafe/quarantine/release (the operator asserted the writer can no longer write).",
    "quarantine_released_pool_gone_total":
        "Quarantined decode transfers whose hold ended because the KV pool itself was torn "
        "down (release_memory_occupation): no page remained to guard.",
    "quarantine_peer_gone_alarm_total":
        "Prefill writers the decode heartbeat declared gone (alarm only: missed heartbeats do "
        "not prove a partitioned writer stopped writing; its quarantined pages stay held).",
    "quarantine_operator_release_total":
        "Operator releases of quarantined pages requested through POST "
        "/pdsafe/quarantine/release (each logged with the writer named).",
    "quarantine_probe_failed_total":
        "Incarnation probes of a quarantined prefill writer's bootstrap server that got no "
        "answer (refused, timed out, not registered yet, garbage); its pages stay held and it "
        "is asked again after SGLANG_PDSAFE_QUARANTINE_PROBE_S.",
    "quarantine_overdue_total":
        "Quarantined decode transfers past upstream's release timeout with neither a drain ACK "
        "nor a new incarnation of their prefill (alarm; the pages stay held, upstream would "
        "reuse them).",
    "quarantine_limit_refused_total":
        "PD requests (and health checks) a decode refused (503) because its quarantined KV "
        "passed SGLANG_PDSAFE_QUARANTINE_LIMIT of the pool.",
    "quarantine_failed_total":
        "Quarantine hooks that failed (hold, release check, door); a failed release check keeps "
        "the pages held and a failed door refuses the request (fail closed).",
    "writes_discarded_total":
        "KV chunks a prefill transfer worker dropped before posting them because their room "
        "had failed, been aborted or been cleared (writers stop before writing).",
    # page generations (issue 9, item 1)
    "page_generation_moved_total":
        "Decode transfers refused (500) at commit, or released after a failure, because pages "
        "(or the Mamba slot) reserved for them were freed, and may have been reused, while "
        "prefill wrote them (a page generation moved; a page-lifecycle bug).",
    "page_generation_source_moved_total":
        "Prefill transfers failed (500) at Success because source pages were freed while the "
        "transfer read them (a page generation moved; the decode's KV digest checks the "
        "bytes).",
    "page_generation_free_skipped_total":
        "Pages a request's release did not free a second time because they had been freed "
        "while its transfer held them (each would have been a double free).",
    "page_generation_failed_total":
        "Page-generation hooks that failed (snapshot, check or release scope). A failed "
        "decode check or a missing decode snapshot refuses the transfer (fail closed).",
    # transfer generations on the wire (issue 9, item 2)
    "stale_kv_status_dropped_total":
        "KV status messages (readiness, Success, Failed) a decode dropped because they did not "
        "carry the transfer generation of the room's live reservation (stale, replayed or "
        "forged; a late Success would have committed pages prefill never wrote).",
    "stale_aux_data_dropped_total":
        "TCP aux data messages a decode dropped: another or no transfer generation, another "
        "metadata slot than the reservation's, or a room the decode holds no reservation of "
        "(upstream would have written that slot).",
    "stale_chunk_ready_dropped_total":
        "Staging CHUNK_READY messages a decode dropped because they did not carry the transfer "
        "generation of the room's live reservation.",
    "stale_abort_dropped_total":
        "ABORT messages a prefill dropped because they named another transfer generation than "
        "the metadata of their decode endpoint for the room (an earlier reservation's ABORT, "
        "replayed or forged: it would have failed the room's live transfer).",
    "stale_abort_ack_dropped_total":
        "ABORT_ACK messages a decode ignored: no deferred release of the room is armed, it "
        "is armed for another generation (late, duplicated, replayed or forged), or the ACK "
        "names no generation (an older peer's format); none of them released a page.",
    "transfer_generation_split_total":
        "Prefill rooms whose decode ranks sent different transfer generations (their "
        "reservations left lockstep); the digest row is zeroed and decode refuses the transfer.",
    "transfer_generation_failed_total":
        "Transfer-generation hooks that failed (mint, record, tag or check). A failed check "
        "drops the message (fail closed); a failed mint leaves the room without a generation.",
    # rolling upgrades: stock peers (issue #11, item 1)
    "stock_peer_paired_total":
        "Prefills without sglang-pdsafe (no pdsafe wire version) a decode paired with because "
        "SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS waives pair-agreement; counted once per prefill.",
    "coverage_waived_total":
        "Transfers from such a stock prefill committed without a coverage attestation because "
        "SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS waives coverage-attestation (per request).",
    # decode capability announcement (issue 11: fork prefill, stock decode)
    "decode_peer_refused_total":
        "Decode ranks a prefill refused to transfer KV to because they announced no "
        "sglang-pdsafe wire version (stock SGLang, or an older fork) or another one (another "
        "release); counted once per decode rank, logged once with both versions. Every "
        "request from it fails at once with that message.",
    "stock_decode_served_total":
        "Decode ranks without a pdsafe announcement a prefill served anyway because "
        "SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS waives decode-protections; counted once per "
        "decode rank.",
    "peer_capability_failed_total":
        "Decode-capability hooks that failed (announcing, recording or checking raised). A "
        "failed check refuses the decode's room (fail closed); a failed announcement leaves "
        "the decode unannounced, so a pdsafe prefill refuses it.",
    # KV content digest (issue 10)
    "kv_digest_mismatch_total":
        "Transfers refused before their first decode step: the KV decode holds for the "
        "request's token range differs from what prefill digested (corruption in the transfer, "
        "the pages or the hardware; or upstream's test injector).",
    "kv_digest_missing_total":
        "Transfers refused before their first decode step: prefill sent no KV digest (a "
        "prefill without it, another release, or one whose digest failed).",
    "kv_digest_invalid_total":
        "Transfers refused before their first decode step: the digest row fails its check, "
        "names another KV layout, another room, generation or token range, or the backend says "
        "the prefill shards the KV differently.",
    "kv_digest_failed_total":
        "KV digests that could not be computed (prefill: the transfer then carries no digest "
        "and decode refuses it; decode: the request is refused).",
    "kv_digest_waived_total":
        "Transfers from a stock prefill (no pdsafe wire version) committed without a KV digest "
        "because SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS waives kv-digest (per request).",
    "kv_digest_verified_total":
        "Transfers whose KV decode verified against prefill's digest before their first "
        "decode step (the rate of checks: zero while PD traffic flows means nothing is "
        "checked).",
    "kv_breaker_opened_total":
        "Times this decode stopped serving because KV digest mismatches reached "
        "SGLANG_PDSAFE_KV_MISMATCH_BREAKER (N in a window; stays stopped until restarted).",
    "kv_breaker_refused_total":
        "New PD requests a decode refused (503) because its KV mismatch breaker is open.",
    # prefill source-page lease (issue 9, item 5)
    "source_lease_released_drained_total":
        "Prefill KV pages of a failed or aborted transfer freed after every transfer worker of "
        "every attention rank drained the room (fences passed, nothing in flight).",
    "source_lease_overdue_total":
        "Prefill source-page leases still held past SGLANG_PDSAFE_SOURCE_LEASE_ALARM_S (alarm; "
        "the pages stay held, upstream would have reused them at once).",
    "source_lease_poisoned_total":
        "Prefill source-page leases whose transfer the backend could not prove settled (a "
        "timed-out Mooncake batch, an unsettled NIXL handle, a MORI failure, a dead worker); "
        "their pages stay held until the prefill restarts.",
    "source_lease_failed_total":
        "Source-lease hooks that failed (arming, taking, checking or freeing a lease). A lease "
        "that took its pages keeps them for good (fail closed); one that could not be armed "
        "leaves the pages to upstream's immediate release.",
    # the failure policy (issue 19)
    "server_poisoned_total":
        "Times this server poisoned itself: a hook whose failure outcome is POISON failed, a "
        "failure outcome itself could not be carried out, or SGLANG_PDSAFE_POISON_AFTER "
        "distinct hook failures were reached. It then refuses new PD requests (503, /health "
        "says why) until it is restarted. Operator: read the server log (CRITICAL 'pdsafe'), "
        "fix the cause, restart.",
    "poisoned_refused_total":
        "PD requests (and health checks) refused with 503 because this server is poisoned.",
    "startup_failed_total":
        "pdsafe startup checks that could not run; the server refused to start.",
    "admission_check_failed_total":
        "Admission checks (input length, client guard, placeholder guard, limits) that could "
        "not run; the request was refused (503), never served unchecked.",
    "coverage_check_failed_total":
        "Coverage-attestation hooks (reservation record, prefill attestation, commit gate) "
        "that could not run; the transfer was refused at once (500/503).",
    "write_fence_failed_total":
        "Writer-fence hooks that could not run (a discarded chunk not counted); the chunk was "
        "dropped regardless.",
    "fake_transfer_served_total":
        "Requests a decode served by a fake transfer (no KV moved: the server's own warmups and "
        "health checks, or the fake backend under SGLANG_PDSAFE_WAIVE_FAKE_TRANSFER=1): their "
        "pages were zeroed first, so they decoded over zeros, never another request's KV.",
    "rows_held_for_good_total":
        "Request KV rows (pages and request slot) pdsafe holds for good because evidence that "
        "no writer can touch them can never come (a release hook failed, a backend could not "
        "prove its writes settled); they are never freed before a restart and stay accounted "
        "to the server (gauge held_rows).",
    # cost (issue 22 item 1): not failures; what the protections' own bookkeeping costs
    "hook_seconds_total":
        "Wall time spent inside pdsafe hooks in this process (outermost hook calls only, so "
        "nested hooks are not counted twice), only with SGLANG_PDSAFE_HOOK_COST=1 (timing "
        "costs about a microsecond per call); flushed at most once a second. Divide by "
        "hook_calls_total or by the served requests for the protections' added time.",
    "hook_calls_total":
        "Outermost pdsafe hook calls in this process (flushed with hook_seconds_total).",
}
GAUGES: dict[str, str] = {
    "transfer_generation_unwired":
        "1 while this PD server runs on a transfer backend whose messages carry no transfer "
        "generation (none in this release), under SGLANG_PDSAFE_WAIVE_UNWIRED_GENERATION=1, "
        "else 0.",
    "transfer_generation_unkeyed":
        "1 while this decode mints unkeyed transfer generations (no launcher prepared a key "
        "and no cluster key is configured: forgeable by someone who can guess a "
        "reservation), else 0.",
    "control_messages_unsigned":
        "1 while this PD server signs and checks no control message (no cluster key "
        "configured, or SGLANG_PDSAFE_CONTROL_MAC=0), else 0.",
    "unclaimed_rooms":
        "Bootstrap rooms whose decode metadata is waiting on this prefill for the room's "
        "request (bounded by SGLANG_PDSAFE_UNCLAIMED_ROOM_LIMIT).",
    "poisoned":
        "1 while this server is poisoned (refuses new PD requests until restarted), else 0.",
    "held_rows":
        "Request KV rows pdsafe holds outside upstream's queues (source leases awaiting drain "
        "evidence, rows held for good); counted as in use by the idle memory check.",
    "quarantined_tokens":
        "KV tokens of decode pages held in quarantine (aborted or failed transfers whose "
        "prefill writers have not acknowledged the drain nor been proven gone).",
    "quarantined_transfers":
        "Aborted or failed transfers whose decode pages are held in quarantine.",
    "source_pages_held":
        "Prefill KV pages held by source leases (failed or aborted transfers whose transfer "
        "workers may still read them).",
    "source_leases_held":
        "Failed or aborted prefill transfers whose source pages are held by a lease.",
}
HISTOGRAMS: dict[str, str] = {
    "peer_release_latency_seconds":
        "Time from a local PD rejection until the peer was told to release its reservation "
        "(the release notice left on the control channel; the peer frees on receipt).",
    "quarantine_age_seconds":
        "How long a decode transfer's pages stayed quarantined before terminal evidence (ACK "
        "or peer gone) released them.",
    "source_lease_hold_seconds":
        "How long a prefill source lease held its pages before the drain evidence freed them.",
}

_lock = threading.Lock()
_local: dict[str, float] = {}
_prom: dict[str, Any] = {}


def _metric(name: str) -> Any | None:
    with _lock:
        if name in _prom:
            return _prom[name]
        try:
            from prometheus_client import Counter, Histogram

            if name in COUNTERS:
                m = Counter(PREFIX + name.removesuffix("_total"), COUNTERS[name])
            elif name in GAUGES:
                from prometheus_client import Gauge

                # One value per scheduler process; the ranks of one TP group hold the same
                # transfers, so the exported value is the largest live one, not a sum.
                m = Gauge(PREFIX + name, GAUGES[name], multiprocess_mode="livemax")
            else:
                m = Histogram(PREFIX + name, HISTOGRAMS[name],
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300,
                                       900, 3600))
        except Exception as e:  # registry unavailable or duplicate: count locally only
            # Counting never depends on export (value() still counts); an operator whose
            # alerts read /metrics must hear that this one is missing (once per name).
            logger.warning("pdsafe metric %s is not exported to /metrics: %s", name, e)
            m = None
        _prom[name] = m
        return m


def inc(name: str, amount: float = 1.0) -> None:
    """Increment the counter ``name`` (must be declared in COUNTERS)."""
    if name not in COUNTERS:
        raise KeyError(f"undeclared pdsafe counter {name!r}")
    with _lock:
        _local[name] = _local.get(name, 0.0) + amount
    m = _metric(name)
    if m is not None:
        m.inc(amount)


def observe(name: str, value: float) -> None:
    """Record ``value`` in the histogram ``name`` (must be declared in HISTOGRAMS)."""
    if name not in HISTOGRAMS:
        raise KeyError(f"undeclared pdsafe histogram {name!r}")
    m = _metric(name)
    if m is not None:
        m.observe(value)


def set_gauge(name: str, value: float) -> None:
    """Set the gauge ``name`` (must be declared in GAUGES) to ``value``."""
    if name not in GAUGES:
        raise KeyError(f"undeclared pdsafe gauge {name!r}")
    with _lock:
        _local[name] = float(value)
    m = _metric(name)
    if m is not None:
        m.set(value)


def value(name: str) -> float:
    """In-process count of ``name`` (for logs and tests of this process)."""
    with _lock:
        return _local.get(name, 0.0)
