"""What a fork leg does with a stock peer (no sglang-pdsafe) during a rolling upgrade.

**Fork decode, stock prefill** (this section) and **fork prefill, stock decode** (the
``decode-protections`` waiver at the end; the mechanism is :mod:`sglang.pdsafe.peer_capability`).

A prefill announces its pdsafe capabilities in the pair settings it publishes at bootstrap
(``pair_agreement``: ``wire_version`` ``sglang-pdsafe-pair/N``; a stock 0.5.23 prefill publishes
none). Three decode protections need the prefill's cooperation:

=========================  ===================================================================
protection                 what a stock prefill lacks
=========================  ===================================================================
``pair-agreement``         it publishes no wire version, context length or chat template
``coverage-attestation``   it writes no attestation into the metadata row
``kv-digest``              it sends no KV digest row (the row stays zero)
=========================  ===================================================================

**Default (safe): refuse.** The decode refuses to pair with such a prefill, once, at bootstrap,
with an error naming both versions and the missing capability (pair agreement); every request
that names it fails at once with that message. Nothing is served unprotected.

**Opt-in for an upgrade window:** ``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS`` lists the protections
to serve without *for prefills that announce no pdsafe wire version* (comma-separated names from
the table). Then:

* ``pair-agreement`` waived: the decode pairs with a stock prefill when upstream's own fields
  (page size, KV dtype and layout) agree; the fields a stock prefill cannot publish are not
  compared. Logged once per prefill (WARNING) and counted once per prefill in
  ``sglang:pdsafe_stock_peer_paired_total``.
* ``coverage-attestation`` waived too: a transfer *from such a prefill* whose row carries no
  attestation at all is committed without the coverage check, counted per request in
  ``sglang:pdsafe_coverage_waived_total``. A row that carries an attestation is always checked,
  and a prefill that announced a pdsafe wire version never gets the waiver (it must attest).
  Waiving only ``pair-agreement`` pairs the prefill but still refuses every transfer from it
  (no attestation): useful only to see the pairs come up before allowing traffic.
* ``kv-digest`` waived too: a transfer *from such a prefill* whose digest row is empty (all
  zero, what a stock prefill leaves) enters its first decode step unverified, counted per
  request in ``sglang:pdsafe_kv_digest_waived_total``. A row that carries a digest is always
  verified; a pdsafe prefill never gets the waiver. Without it (the default) every transfer
  from a stock prefill fails the KV integrity check ("no digest"), so a rolling upgrade with
  the digest on lists all three: ``pair-agreement,coverage-attestation,kv-digest``.

Fork prefills of another release announce another wire version: they are refused at bootstrap
(``pair_agreement``), never waived here.

**Fork prefill, stock decode.** A decode announces its pdsafe wire version to a pdsafe prefill
before it registers (``peer_capability``); a stock decode announces nothing. The guarantees
the prefill gives its clients need the decode's own protections (coverage check and commit
gate, KV digest check, page quarantine, room guard), so by default the prefill refuses a decode
that announced no wire version, or another one: every room it sends metadata for fails at once,
with an error naming both versions and the missing capability (logged and counted once per
decode rank). ``decode-protections`` in ``SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS`` (set on the
prefill) serves decodes that announced *nothing* (logged once per decode rank as a WARNING,
counted once in ``sglang:pdsafe_stock_decode_served_total``); a decode that announced another
wire version is never waived.

Invariant: a waiver applies only to a peer that announced no pdsafe wire version, only for
the protections listed, and is visible (one WARNING per peer, counters).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from sglang.pdsafe import metrics, transfer
from sglang.pdsafe.protections import Protection, register

logger = logging.getLogger("sglang.pdsafe.peer_policy")

ENV_WAIVE = "SGLANG_PDSAFE_WAIVE_FOR_STOCK_PEERS"
PAIR_AGREEMENT = "pair-agreement"
COVERAGE = "coverage-attestation"
KV_DIGEST = "kv-digest"
#: Waived on a prefill: serve decodes that announce no pdsafe wire version (peer_capability).
DECODE_PROTECTIONS = "decode-protections"
WAIVABLE: tuple[str, ...] = (PAIR_AGREEMENT, COVERAGE, KV_DIGEST, DECODE_PROTECTIONS)
#: The waivers that concern stock prefills (read by a decode).
PREFILL_WAIVABLE: frozenset[str] = frozenset({PAIR_AGREEMENT, COVERAGE, KV_DIGEST})

_warned_unknown: set[str] = set()


def waived() -> frozenset[str]:
    """The protections waived for stock prefills (unknown names are ignored: logged once as an
    ERROR, they waive nothing, so a typo never turns a protection off)."""
    raw = os.environ.get(ENV_WAIVE, "")
    names = {n.strip() for n in raw.split(",") if n.strip()}
    unknown = names - set(WAIVABLE)
    for name in sorted(unknown - _warned_unknown):
        _warned_unknown.add(name)
        logger.error("pdsafe: %s names %r, which is not a waivable protection (%s); it waives "
                     "nothing", ENV_WAIVE, name, ", ".join(WAIVABLE))
    return frozenset(names & set(WAIVABLE))


register(Protection(
    name="stock-peer-refusal",
    guards="a decode pairs with and commits from prefills that announce an sglang-pdsafe wire "
           "version only, and a prefill transfers KV only to decodes that announce this "
           "release's wire version (stock peers refused at bootstrap, never served unprotected)",
    switched_off=lambda _args: (f"{ENV_WAIVE}={','.join(sorted(waived()))} (waived for "
                                "stock peers only)" if waived() else None),
))


class StockPeers:
    """Prefills this decode paired with although they announce no pdsafe wire version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._addrs: set[str] = set()

    def add(self, addr: str) -> bool:
        """Record ``addr``; True the first time."""
        with self._lock:
            if addr in self._addrs:
                return False
            self._addrs.add(addr)
            return True

    def __contains__(self, addr: object) -> bool:
        with self._lock:
            return addr in self._addrs


def stock_peers(kv_mgr: Any) -> StockPeers:
    return transfer.leg(kv_mgr).table("stock_peers", StockPeers)


def pair_waived() -> bool:
    return PAIR_AGREEMENT in waived()


def decode_protections_waived() -> bool:
    """Whether this prefill serves decodes that announce no pdsafe wire version."""
    return DECODE_PROTECTIONS in waived()


def note_stock_peer(kv_mgr: Any, addr: str, wire_version_mine: str) -> None:
    """Pair agreement accepted a stock prefill under the waiver: remember it, tell the operator
    once per prefill."""
    if not stock_peers(kv_mgr).add(str(addr)):
        return
    metrics.inc("stock_peer_paired_total")
    active = sorted(waived() & PREFILL_WAIVABLE)
    logger.warning(
        "pdsafe: paired with prefill %s, which announces no sglang-pdsafe wire version (a stock "
        "SGLang or an older fork; this decode speaks %s), because %s waives %s for such peers. "
        "Served for this prefill without: %s. Remove the waiver once every prefill runs "
        "sglang-pdsafe.", addr, wire_version_mine, ENV_WAIVE, ", ".join(active),
        ", ".join(active))


def coverage_waived(decode_req: Any) -> bool:
    """Whether a transfer without any attestation may be committed: only from a prefill paired
    as a stock peer, with ``coverage-attestation`` waived. Counts each waived transfer."""
    if COVERAGE not in waived():
        return False
    receiver = getattr(decode_req, "kv_receiver", None)
    kv_mgr = getattr(receiver, "kv_mgr", None)
    addr = getattr(receiver, "bootstrap_addr", None)
    if kv_mgr is None or addr is None or str(addr) not in stock_peers(kv_mgr):
        return False
    metrics.inc("coverage_waived_total")
    return True


def digest_waivable(decode_req: Any) -> bool:
    """Whether a transfer whose KV digest row is empty may decode unverified: only from a
    prefill paired as a stock peer, with ``kv-digest`` waived (``kv_integrity`` decides at the
    check, from the row, and counts each waived transfer)."""
    if KV_DIGEST not in waived():
        return False
    receiver = getattr(decode_req, "kv_receiver", None)
    kv_mgr = getattr(receiver, "kv_mgr", None)
    addr = getattr(receiver, "bootstrap_addr", None)
    return kv_mgr is not None and addr is not None and str(addr) in stock_peers(kv_mgr)
