"""What a PD leg publishes to its peer at pairing, and what a decode learned from each prefill.

This is the wire floor shared by the checks that need it: pair agreement (compares the
settings), the decode's capability announcement (announces only to prefills of this wire
version), the transfer generation (sends one only to them) and the quarantine (the writer's
process incarnation is its release evidence). Nothing here decides anything.

* :data:`WIRE_VERSION`: the version of the fork's PD wire protocol (bump when a field changes
  meaning or a message is added). Readers look it up at call time (``pair_settings.
  WIRE_VERSION``), so the testkit can make a server speak as another release.
* :data:`INCARNATION`: a random id of this server process, minted at import. A prefill
  publishes it with its settings when it registers with its bootstrap server; a new process
  (a restart) publishes a new one. A decode that registered with a prefill whose incarnation
  it sees change knows the old process is gone.
* :class:`PairSettings`: what one leg publishes.
* The decode's table of what each prefill published (:func:`remember`,
  :func:`prefill_wire_version`, :func:`prefill_incarnation`), a table of the KV manager's leg.

Invariant: the table keeps, per prefill bootstrap address, what that prefill published the
last time this decode fetched its settings, bounded (:data:`MAX_PREFILLS`, oldest dropped).
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from sglang.pdsafe import transfer

#: Version of the fork's PD wire protocol: what :class:`PairSettings` carries, and the
#: messages a pdsafe peer understands.
#: /2: a decode announces itself to a prefill of this version (``peer_capability``); a prefill
#: of /1 would misparse that announcement, so a /2 decode sends it to /2 prefills only.
#: /3: decode metadata and every prefill message for it carry the transfer generation
#: (``transfer_generation``); a /3 decode drops a status without it, so /2 pairs are refused.
#: /4: the coverage row's token digest binds the transfer generation (layout 2) and ABORT /
#: ABORT_ACK name it: a /3 leg would refuse every /4 row ("no attestation"), so /3 pairs are
#: refused at pairing instead.
#: /5: the transfer messages carry a MAC under the cluster key (``control_mac``) and each leg
#: publishes its key ids (``control_key``): a /4 leg would read the MAC frame as its generation
#: frame, so /4 pairs are refused at pairing.
#: /6: the coverage row binds the metadata slot's aux rows (layout 3), and a keyed leg signs
#: (and requires signed) ABORT, ABORT_ACK and BOOTSTRAP: a /5 leg's coverage rows would all be
#: refused and its unsigned ABORTs dropped, so /5 pairs are refused at pairing.
#: /7: the KV digest row carries the digest sealed with the cluster key (``kv_integrity`` row
#: version 2): a /6 leg's rows would all read as another release's, so /6 pairs are refused.
WIRE_VERSION = "sglang-pdsafe-pair/7"
#: This process's incarnation (see the module doc).
INCARNATION = secrets.token_hex(8)
#: Prefills remembered per decode; the oldest are forgotten first.
MAX_PREFILLS = 1024


@dataclass(frozen=True)
class PairSettings:
    """What one leg publishes. ``None`` means "this leg could not tell" (never a mismatch by
    itself, except ``wire_version``: a prefill without sglang-pdsafe publishes nothing).
    ``incarnation`` is never compared: it identifies the process, not a setting."""

    wire_version: str | None
    page_size: int | None
    kv_cache_dtype: str | None
    kv_layout: str | None
    context_length: int | None
    chat_template: str | None
    max_prompt_tokens: int | None = None
    #: The KV digest scheme this leg sends/verifies, or "off" (``kv_integrity.advertised``).
    kv_digest: str | None = None
    incarnation: str | None = None
    #: The ids of the cluster keys this leg signs with (first) and accepts
    #: (``control_mac.advertised``).
    control_key: str | None = None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> PairSettings | None:
        """The settings a peer published, or None when it published none (or garbage)."""
        if not isinstance(data, dict):
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: data.get(k) for k in known})


#: Settings a protection publishes at pairing, by field: ``fn(server_args) -> value`` (the
#: KV digest registers ``kv_digest``). Both legs compute them the same way.
ADVERTISED: dict[str, Callable[[Any], str | None]] = {}


def advertise(field_name: str, fn: Callable[[Any], str | None]) -> None:
    """Register how this leg computes the published ``field_name``."""
    ADVERTISED[field_name] = fn


#: Fields whose values agree by a rule other than equality: ``fn(prefill, decode) -> bool``
#: (the control key: a rotation in progress agrees).
COMPARATORS: dict[str, Callable[[Any, Any], bool]] = {}


def comparator(field_name: str, fn: Callable[[Any, Any], bool]) -> None:
    """Register how pair agreement decides whether two published ``field_name`` agree."""
    COMPARATORS[field_name] = fn


def agree(field_name: str, prefill: Any, decode: Any) -> bool:
    """Whether the two legs' values of ``field_name`` agree (equality unless a comparator
    was registered)."""
    fn = COMPARATORS.get(field_name)
    return prefill == decode if fn is None else bool(fn(prefill, decode))


def advertised(field_name: str, server_args: Any) -> str | None:
    """The value this leg publishes for ``field_name``; a field no protection registered is
    published as ``"unregistered"`` (a decode compares it like any value: fail closed)."""
    fn = ADVERTISED.get(field_name)
    return "unregistered" if fn is None else fn(server_args)


#: Orders every observation of a prefill's incarnation in this process (pairing fetches and
#: the quarantine's probe): a later observation has a larger number.
_observations = itertools.count(1)


def observation() -> int:
    """The order number of an observation made now (larger: later)."""
    return next(_observations)


@dataclass(frozen=True)
class Published:
    """What one prefill published when this decode last fetched its settings, and the order
    of that fetch among all observations (``seen``: the quarantine compares it with its
    probe's answers, so that an older observation never overrides a newer one)."""

    wire_version: str | None
    incarnation: str | None
    seen: int = field(default_factory=observation, compare=False)
    #: Its ``control_key`` setting (the ids of the cluster keys it signs with and accepts).
    control_key: str | None = field(default=None, compare=False)


class _Table:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefills: OrderedDict[str, Published] = OrderedDict()


def _table(kv_mgr: Any) -> _Table:
    return transfer.leg(kv_mgr).table("pair_settings", _Table)


def incarnation_seen(leg: transfer.Leg, bootstrap_addr: str) -> str | None:
    """:func:`prefill_incarnation` for a leg in hand (the quarantine's evidence)."""
    p = published_seen(leg, bootstrap_addr)
    return None if p is None else p.incarnation


def published_seen(leg: transfer.Leg, bootstrap_addr: str) -> Published | None:
    """What the prefill at ``bootstrap_addr`` published at this leg's last pairing with it,
    with the time it was fetched (None: never fetched)."""
    t = leg.tables().get("pair_settings")
    if t is None:
        return None
    with t.lock:
        return t.prefills.get(bootstrap_addr)


#: The bootstrap server's ``GET /route`` query that answers a prefill's whole topology and,
#: to a decode that asks (``pdsafe_pair=1``), its pair settings (``pair_agreement``, and the
#: quarantine's incarnation probe).
ROUTE_QUERY = ("route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
               "&target_pp_rank=-1&pdsafe_pair=1")


def route_url(bootstrap_addr: str) -> str:
    """The URL a decode fetches the pair settings of the prefill at ``bootstrap_addr`` from."""
    return f"http://{bootstrap_addr}/{ROUTE_QUERY}"


def remember(kv_mgr: Any, bootstrap_addr: str, settings: PairSettings | None) -> Published:
    """Record what the prefill at ``bootstrap_addr`` published (None: nothing, a stock
    prefill); returns what it published before (``Published(None, None)`` if unknown)."""
    version = settings.wire_version if settings is not None else None
    incarnation = settings.incarnation if settings is not None else None
    control_key = getattr(settings, "control_key", None)
    new = Published(version if isinstance(version, str) else None,
                    incarnation if isinstance(incarnation, str) else None,
                    control_key=control_key if isinstance(control_key, str) else None)
    t = _table(kv_mgr)
    with t.lock:
        old = t.prefills.get(bootstrap_addr, Published(None, None))
        t.prefills[bootstrap_addr] = new
        t.prefills.move_to_end(bootstrap_addr)
        while len(t.prefills) > MAX_PREFILLS:
            t.prefills.popitem(last=False)
    return old


def _published(kv_mgr: Any, bootstrap_addr: str) -> Published | None:
    t = _table(kv_mgr)
    with t.lock:
        return t.prefills.get(bootstrap_addr)


def prefill_wire_version(kv_mgr: Any, bootstrap_addr: str) -> str | None:
    """The pdsafe wire version the prefill at ``bootstrap_addr`` published when this decode
    last paired with it (None: it published none, a stock prefill, or it was never fetched).
    ``peer_capability`` announces this decode only to a prefill of this release's version."""
    p = _published(kv_mgr, bootstrap_addr)
    return None if p is None else p.wire_version


def prefill_control_key(kv_mgr: Any, bootstrap_addr: str) -> str | None:
    """The ``control_key`` setting the prefill at ``bootstrap_addr`` published when this
    decode last paired with it (None: none, or never fetched)."""
    p = _published(kv_mgr, bootstrap_addr)
    return None if p is None else p.control_key


def prefill_incarnation(kv_mgr: Any, bootstrap_addr: str) -> str | None:
    """The process incarnation the prefill at ``bootstrap_addr`` published when this decode
    last paired with it (None: unknown; a stock prefill publishes none)."""
    p = _published(kv_mgr, bootstrap_addr)
    return None if p is None else p.incarnation
