"""Settings both legs of a PD pair must share, compared when decode first pairs with a prefill.

A prefill and a decode that disagree on the page size, the KV cache dtype or layout, the
context length or the chat template do not serve one model the same way: decode reserves
pages prefill does not fill, reads KV of another dtype, or admits prompts the other side
shapes differently. Upstream 0.5.23 compares page size, KV dtype and KV layout in
``CommonKVManager.try_ensure_parallel_info`` on decode, but answers a mismatch with a
``RuntimeError`` raised inside the decode scheduler's event loop (the first request that names
such a prefill, with a client-chosen ``bootstrap_host``, stops the decode scheduler), and it
publishes neither the context length nor the chat template.

Here:

* **Publish** (prefill): :func:`published` computes this server's :class:`PairSettings`
  (wire version, page size, effective context length, longest accepted prompt, chat-template
  digest, KV dtype and layout, KV digest scheme or ``off``: a verifying decode never pairs
  with a fork prefill that sends no digest); the prefill's ``_init_kv_manager`` puts them in
  its ``KVArgs``, ``register_to_bootstrap`` sends them with the topology row, and the
  bootstrap server returns them in ``GET /route`` to a decode that asks (``?pdsafe_pair=1``):
  a stock decode builds ``PrefillServerInfo(**payload)`` and would fail on an unknown key, so
  it never gets one.
* **Compare** (decode): :func:`ensure_prefill_info` replaces the decode's call of
  ``try_ensure_parallel_info``. It compares the prefill's published settings with its own
  (:func:`compare`: every differing field, with both values) and turns upstream's own
  ``RuntimeError`` checks into the same refusal. A refused prefill is logged once (ERROR,
  naming every differing value) and counted once in ``pair_setting_mismatch_total``; every
  request that targets it fails at once with that message (decode's client gets a 500, the
  prefill is told through peer release and fails its side with the same reason), and the
  decode keeps serving every other prefill. The verdict is kept for ``RECHECK_S`` seconds, then
  the prefill is asked again (an operator who restarts it with matching settings needs no
  decode restart).

``max_prompt_tokens`` is published and logged at pairing (the pair admits the smaller of the
two legs' limits) but not required to be equal: each leg refuses its own over-limit prompts at
HTTP and tells the other leg (peer release), and the decode's limit is lower by design (it
reserves ``--num-reserved-decode-tokens``).

Off switch (default on): ``SGLANG_PDSAFE_PAIR_AGREEMENT=0`` turns the comparison off,
``SGLANG_PDSAFE_PAIR_AGREEMENT_SKIP=context_length,chat_template`` skips named fields (both
logged as a warning at startup). Upstream's own checks still apply either way, as refusals.

Invariant: a decode never transfers KV with a prefill whose published settings differ from
its own in an enforced field, never raises out of the pairing step into the scheduler, and
every request that targets a refused prefill ends within one scheduler pass with an error
naming both values. Failure policy: a pairing step that cannot run refuses the requests of
that prefill at once; a prefill that cannot compute its settings publishes a marker no decode
pairs with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from sglang.pdsafe import (
    control_mac,  # noqa: F401 - publishes and compares the control_key setting
    metrics,
    pair_settings,
    peer_notifier,
    peer_policy,
    policy,
    transfer,
)
from sglang.pdsafe.hook_api import require
from sglang.pdsafe.pair_settings import PairSettings
from sglang.pdsafe.policy import Outcome, hook
from sglang.pdsafe.protections import Protection, register, switch_on
from sglang.srt.disaggregation.base.conn import KVPoll

logger = logging.getLogger("sglang.pdsafe.pair_agreement")

#: The wire version (re-exported; readers that must see the testkit's override read
#: ``pair_settings.WIRE_VERSION`` at call time).
WIRE_VERSION = pair_settings.WIRE_VERSION
ENV_ENABLE = "SGLANG_PDSAFE_PAIR_AGREEMENT"
ENV_SKIP = "SGLANG_PDSAFE_PAIR_AGREEMENT_SKIP"
MISMATCH = "pair_setting_mismatch_total"
FAILED = "pair_agreement_failed_total"
#: Fields a pair must share (the order of the error message).
ENFORCED: tuple[str, ...] = ("wire_version", "page_size", "kv_cache_dtype", "kv_layout",
                             "context_length", "chat_template", "kv_digest", "control_key")
#: Seconds a refusal stands before the prefill is asked again.
RECHECK_S = 10.0
#: Prefills remembered per decode (refused or logged); the oldest are forgotten first.
MAX_PREFILLS = 1024

_KV_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager"
# (Also the instance attribute prefill_info_table, which a class-level check cannot see.)
require(_KV_MANAGER, "try_ensure_parallel_info(bootstrap_addr)",
        "record_failure(bootstrap_room, failure_reason)", "update_status(bootstrap_room, status)",
        why="decode pairs with a prefill through try_ensure_parallel_info, and fails the requests "
            "that target a refused prefill with the reason (pair agreement)")
require("sglang.srt.disaggregation.base.conn.KVArgs", "pdsafe_pair",
        why="the prefill's pair settings travel to register_to_bootstrap in its KVArgs")
require("sglang.srt.disaggregation.base.conn.KVPoll", "Failed",
        why="a request that targets a refused prefill is failed with this status")



def enabled() -> bool:
    """Pair agreement is on unless ``SGLANG_PDSAFE_PAIR_AGREEMENT`` is 0/false/off/no."""
    return switch_on(ENV_ENABLE)


def skipped_fields() -> frozenset[str]:
    """Enforced fields an operator turned off with ``SGLANG_PDSAFE_PAIR_AGREEMENT_SKIP``."""
    raw = os.environ.get(ENV_SKIP, "")
    return frozenset(f.strip() for f in raw.split(",") if f.strip())


register(Protection(
    name="pair-agreement",
    guards="decode refuses to pair with a prefill whose page size, KV dtype/layout, context "
           "length or chat template differs (error names both values, requests fail at once)",
    switched_off=lambda _args: (f"{ENV_ENABLE}=0" if not enabled() else
                                f"{ENV_SKIP}={','.join(sorted(skipped_fields()))}"
                                if skipped_fields() & set(ENFORCED) else None),
))


# --------------------------------------------------------------------------- the settings


@dataclass(frozen=True)
class Mismatch:
    """One enforced field whose values differ between the legs."""

    field: str
    prefill: Any
    decode: Any

    def __str__(self) -> str:
        return f"{self.field}: prefill={self.prefill!r}, decode={self.decode!r}"


def compare(prefill: PairSettings | None, decode: PairSettings, *,
            skip: frozenset[str] = frozenset()) -> list[Mismatch]:
    """Every enforced field that differs, with both values (empty: the pair agrees).

    A prefill that published nothing differs in ``wire_version`` (it runs without
    sglang-pdsafe or with another wire version). A field one side could not determine
    (``None``) is not compared, except ``wire_version``. ``kv_layout`` ``None`` on both sides
    is upstream's "pool with one layout" and agrees.
    """
    if prefill is None:
        prefill = PairSettings(None, None, None, None, None, None)
    out: list[Mismatch] = []
    for name in ENFORCED:
        if name in skip:
            continue
        p, d = getattr(prefill, name), getattr(decode, name)
        if name != "wire_version" and (p is None or d is None):
            continue
        if not pair_settings.agree(name, p, d):
            out.append(Mismatch(name, p, d))
    return out


REMEDIES = {
    "wire_version": "run the same sglang-pdsafe release on both servers",
    "page_size": "start both with the same --page-size",
    "kv_cache_dtype": "start both with the same --kv-cache-dtype (and --dtype)",
    "kv_layout": "start both with the same KV layout options",
    "context_length": "start both with the same --context-length (each pool at least that "
                      "large, or --disaggregation-clamp-context-to-kv-capacity on both with "
                      "equal pools)",
    "chat_template": "start both with the same --chat-template (or the same tokenizer)",
    "kv_digest": "run both with the same SGLANG_PDSAFE_KV_DIGEST (unset: on) and the same "
                 "sglang-pdsafe release",
    "kv_sharding": "shard both legs' KV alike (the same attention TP, PP and attention-CP sizes, "
                   "no DSA layer split or KV-cache sharding on the prefill): the KV digest "
                   "cannot verify heterogeneous parallelism yet; or run both legs with "
                   "SGLANG_PDSAFE_KV_DIGEST=0 (warned: transferred KV is then not verified)",
    "control_key": "set the same SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN (or --api-key) on "
                   "both legs (during a key rotation, each leg's first key must be one the other "
                   "lists) and the same SGLANG_PDSAFE_CONTROL_MAC",
}


def refusal_message(prefill_addr: str, mismatches: list[Mismatch]) -> str:
    """The error both clients and the decode log read: every differing value and the fix."""
    fixes = "; ".join(dict.fromkeys(REMEDIES.get(m.field, "align it") for m in mismatches))
    return (f"pdsafe: this decode server refuses to pair with the prefill at {prefill_addr}: "
            f"settings both PD legs must share differ: "
            f"{'; '.join(str(m) for m in mismatches)}. Fix: {fixes}.")


def chat_template_digest(server_args: Any) -> str | None:
    """A short digest of the chat template this server renders with (None: cannot tell).

    ``--chat-template`` naming a file: digest of its content; naming a built-in template: its
    name; otherwise the tokenizer's own template (``chat_template.jinja`` or the
    ``chat_template`` field of ``tokenizer_config.json`` in the tokenizer directory), or
    ``"none"`` when it has none. Both legs compute it the same way from their own arguments.
    """
    ct = getattr(server_args, "chat_template", None)
    if ct:
        p = Path(str(ct))
        if p.is_file():
            return "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        return f"name:{ct}"
    base = Path(str(getattr(server_args, "tokenizer_path", None)
                    or getattr(server_args, "model_path", "") or ""))
    if not base.is_dir():
        return None  # a hub id resolved elsewhere: this leg cannot tell
    jinja = base / "chat_template.jinja"
    if jinja.is_file():
        return "sha256:" + hashlib.sha256(jinja.read_bytes()).hexdigest()[:16]
    cfg = base / "tokenizer_config.json"
    if cfg.is_file():
        try:
            tpl = json.loads(cfg.read_text()).get("chat_template")
        except (OSError, ValueError):
            return None
        if tpl:
            blob = tpl if isinstance(tpl, str) else json.dumps(tpl, sort_keys=True)
            return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    return "none"


def local_settings(scheduler: Any, kv_args: Any) -> PairSettings:
    """This leg's settings, from its scheduler and the ``KVArgs`` its KV manager runs with.

    The context length is the tp worker's effective one (after the capacity invariant) and the
    longest prompt ``max_req_input_len - 1`` (both as ``/model_info`` advertises them).
    """
    worker = getattr(scheduler, "tp_worker", None)
    model_config = getattr(worker, "model_config", None) or getattr(scheduler, "model_config",
                                                                   None)
    ctx = getattr(model_config, "context_len", None)
    limit = getattr(scheduler, "max_req_input_len", None)
    return PairSettings(
        wire_version=pair_settings.WIRE_VERSION,
        page_size=int(kv_args.page_size) if getattr(kv_args, "page_size", None) else None,
        kv_cache_dtype=(str(kv_args.kv_cache_dtype_str)
                        if getattr(kv_args, "kv_cache_dtype_str", None) is not None else None),
        kv_layout=getattr(kv_args, "kv_layout", None),
        context_length=int(ctx) if ctx is not None else None,
        chat_template=chat_template_digest(getattr(scheduler, "server_args", None)),
        max_prompt_tokens=int(limit) - 1 if limit is not None else None,
        kv_digest=pair_settings.advertised("kv_digest", getattr(scheduler, "server_args", None)),
        incarnation=pair_settings.INCARNATION,
        control_key=pair_settings.advertised("control_key",
                                             getattr(scheduler, "server_args", None)),
    )


#: What a prefill that cannot compute its settings publishes: a wire version no decode
#: shares (never waived as a stock peer), so every decode refuses to pair, naming it.
PUBLISH_FAILED = "sglang-pdsafe-pair/settings-unavailable"


@hook("pair_agreement.published", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=lambda failure: {"wire_version": PUBLISH_FAILED},
      effect="the prefill publishes a wire version no decode shares: every decode refuses "
             "to pair with it, naming it (never waived as a stock peer)")
def published(scheduler: Any, kv_args: Any) -> dict[str, Any] | None:
    """What a prefill registers with its bootstrap server."""
    return local_settings(scheduler, kv_args).to_wire()


# --------------------------------------------------------------------------- decode side


class _Verdicts:
    """Per decode KV manager: the refused prefills (message, until) and the logged ones."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refused: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.logged: OrderedDict[str, str] = OrderedDict()

    def remember(self, table: OrderedDict[str, Any], key: str, value: Any) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > MAX_PREFILLS:
            table.popitem(last=False)


def _verdicts(kv_mgr: Any) -> _Verdicts:
    return transfer.leg(kv_mgr).table("pair_agreement", _Verdicts)


def _remember_published(kv_mgr: Any, bootstrap_addr: str, info: Any) -> None:
    """Record what the prefill published (whom ``peer_capability`` announces to; the
    incarnation the quarantine's evidence compares with)."""
    pair_settings.remember(kv_mgr, bootstrap_addr,
                           PairSettings.from_wire(_field(info, "pdsafe_pair")))


def prefill_wire_version(kv_mgr: Any, bootstrap_addr: str) -> str | None:
    """See :func:`pair_settings.prefill_wire_version`."""
    return pair_settings.prefill_wire_version(kv_mgr, bootstrap_addr)


def _decode_settings(queue: Any) -> PairSettings:
    return local_settings(queue.scheduler, queue.kv_manager.kv_args)


def _field(info: Any, name: str) -> Any:
    return info.get(name) if isinstance(info, dict) else getattr(info, name, None)


def _check(queue: Any, bootstrap_addr: str, info: Any) -> str | None:
    """The refusal message for the prefill ``info`` describes (a ``PrefillServerInfo`` or the
    ``GET /route`` JSON), or None when it agrees (or the comparison is off)."""
    if not enabled() or info is None:
        return None
    mine = _decode_settings(queue)
    theirs = PairSettings.from_wire(_field(info, "pdsafe_pair"))
    stock = theirs is None
    if stock:
        # A prefill without the pdsafe block still published upstream's fields.
        theirs = PairSettings(None, _field(info, "page_size"), _field(info, "kv_cache_dtype"),
                              _field(info, "kv_layout"), None, None)
    skip = skipped_fields()
    if stock and peer_policy.pair_waived():  # rolling upgrade: the operator's explicit waiver
        skip = skip | {"wire_version"}
    found = compare(theirs, mine, skip=skip)
    if not stock and "kv_sharding" not in skip:
        found += sharding_mismatches(info, queue.kv_manager, theirs, mine)
    if not found:
        if stock and peer_policy.pair_waived():
            peer_policy.note_stock_peer(queue.kv_manager, bootstrap_addr,
                                        pair_settings.WIRE_VERSION)
        _log_pairing(queue.kv_manager, bootstrap_addr, theirs, mine)
        return None
    return refusal_message(bootstrap_addr, found)


def kv_sharding(attn_tp: Any, pp: Any, attn_cp: Any, layer_split: Any = False,
                page_sharding: Any = False) -> str:
    """How a leg shards its KV across ranks (``attn_tp=T,pp=P,attn_cp=C`` [, layer split, page
    sharding]): the unit one rank's KV digest covers."""
    out = f"attn_tp={attn_tp},pp={pp},attn_cp={attn_cp}"
    return out + (",dsa-layer-split" if layer_split else "") + (
        ",kv-cache-sharding" if page_sharding else "")


def sharding_mismatches(info: Any, kv_mgr: Any, prefill: PairSettings,
                        decode: PairSettings) -> list[Mismatch]:
    """The KV digest verifies each decode rank's KV against the digest of the one prefill rank
    that wrote it; with another TP, PP or attention-CP size on the two legs (heterogeneous
    parallelism), or a prefill that splits its DSA cache by layer or shards pages, the digests
    cover other bytes and every transfer would fail (500). Refused at pairing instead, naming
    both layouts. Not compared when the digest is off on both legs (pair agreement keeps the
    ``kv_digest`` setting equal), or when the prefill published no topology."""
    if "off" in (prefill.kv_digest, decode.kv_digest):
        return []
    tp, pp, cp = (_field(info, k) for k in ("attn_tp_size", "pp_size", "attn_cp_size"))
    if tp is None or pp is None:
        return []
    theirs = kv_sharding(tp, pp, cp or 1, _field(info, "enable_dsa_cache_layer_split"),
                         _field(info, "enable_kv_cache_sharding"))
    mine = kv_sharding(kv_mgr.attn_tp_size, kv_mgr.pp_size, getattr(kv_mgr, "attn_cp_size", 1))
    return [] if theirs == mine else [Mismatch("kv_sharding", theirs, mine)]


def _fetch_info(bootstrap_addr: str) -> dict[str, Any] | None:
    """The prefill's ``GET /route`` answer (what upstream fetched before its check raised);
    None while it does not answer (not up yet: asked again next round)."""
    try:
        r = requests.get(pair_settings.route_url(bootstrap_addr), timeout=2)
        return r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None  # the refusal then quotes upstream's own message


def _log_pairing(kv_mgr: Any, addr: str, prefill: PairSettings, decode: PairSettings) -> None:
    """Once per prefill: the pair's prompt limit (the smaller of both legs')."""
    v = _verdicts(kv_mgr)
    with v.lock:
        if addr in v.logged:
            return
        v.remember(v.logged, addr, "ok")
    logger.info("%s", pairing_message(addr, prefill.max_prompt_tokens,
                                      decode.max_prompt_tokens))


def pairing_message(prefill_addr: str, prefill_limit: int | None,
                    decode_limit: int | None) -> str:
    """The INFO line a decode logs once per prefill it pairs with: the pair's prompt limit (the
    smaller of both legs' ``max_prompt_tokens``; pure, quoted by docs/operator-guide.md)."""
    limits = [x for x in (prefill_limit, decode_limit) if x is not None]
    return (f"pdsafe: paired with prefill {prefill_addr} (settings agree); the pair accepts "
            f"prompts of at most {min(limits) if limits else '?'} tokens (prefill "
            f"{prefill_limit}, decode {decode_limit})")


def _refuse(queue: Any, bootstrap_addr: str, message: str, decode_reqs: list[Any], *,
            verdict: bool = True) -> bool:
    """Fail every request now; with ``verdict`` (a fresh comparison) also record the refusal
    for ``RECHECK_S`` and, the first time for this prefill and message, log and count it.
    Returns True once the requests are failed."""
    kv_mgr = queue.kv_manager
    if verdict:
        v = _verdicts(kv_mgr)
        with v.lock:
            first = v.logged.get(bootstrap_addr) != message
            v.remember(v.logged, bootstrap_addr, message)
            v.remember(v.refused, bootstrap_addr, (message, time.monotonic() + RECHECK_S))
        if first:
            metrics.inc(MISMATCH)
            logger.error("%s Requests that name this prefill fail until it is restarted with "
                         "matching settings (checked again every %.0f s).", message, RECHECK_S)
    _fail_requests(kv_mgr, message, decode_reqs)
    return True


def _fail_requests(kv_mgr: Any, message: str, decode_reqs: list[Any]) -> None:
    """Fail each request's room with ``message`` (decode's queue aborts it in this pass) and
    tell its prefill to drop the room with the same reason (peer release)."""
    for decode_req in decode_reqs:
        req = decode_req.req
        room = req.bootstrap_room
        if room is None or decode_req.kv_receiver is None:  # None: already cleaned up
            continue
        kv_mgr.record_failure(room, message)
        kv_mgr.update_status(room, KVPoll.Failed)
        peer_notifier.notify_prefill(req.bootstrap_host, req.bootstrap_port, room, message,
                                     dp_rank=getattr(req, "disagg_prefill_dp_rank", None))


def _refused(kv_mgr: Any, bootstrap_addr: str) -> str | None:
    """The standing refusal of this prefill, if any (None after ``RECHECK_S``)."""
    v = _verdicts(kv_mgr)
    with v.lock:
        rec = v.refused.get(bootstrap_addr)
        if rec is None:
            return None
        if time.monotonic() >= rec[1]:
            v.refused.pop(bootstrap_addr, None)
            return None
        return rec[0]


def _pairing_failed(failure: policy.Failure) -> None:
    """The pairing step could not run: the requests that name this prefill are refused now
    (their prefill told), and it is asked again on the next request."""
    queue, bootstrap_addr, decode_reqs = failure.args[0], failure.args[1], failure.args[2]
    refusal = failure.refusal(503, f"the request (this decode could not check its pairing "
                                   f"with the prefill at {bootstrap_addr})")
    _fail_requests(queue.kv_manager, refusal.reason, decode_reqs)
    return None


@hook("pair_agreement.ensure_prefill_info", outcome=Outcome.REFUSE, counter=FAILED,
      on_failure=_pairing_failed,
      key=lambda queue, addr, reqs: ("pairing", addr, tuple(getattr(r.req, "rid", "")
                                                             for r in reqs)),
      effect="the requests naming that prefill fail at once (503; their prefill told)")
def ensure_prefill_info(queue: Any, bootstrap_addr: str, decode_reqs: list[Any]) -> bool | None:
    """Decode's pairing step for the prefill at ``bootstrap_addr`` (replaces the call of
    ``kv_manager.try_ensure_parallel_info`` in ``DecodePreallocQueue._ensure_prefill_info``).

    Returns True when the prefill's info is cached and its settings agree (pair as upstream
    does), False when it could not be fetched yet (upstream's retry path), and None when the
    prefill is refused: ``decode_reqs`` are failed already and the caller drops them.
    """
    kv_mgr = queue.kv_manager
    message = _refused(kv_mgr, bootstrap_addr)
    if message is not None:
        failed = _refuse(queue, bootstrap_addr, message, decode_reqs, verdict=False)
        return None if failed else False
    known = bootstrap_addr in kv_mgr.prefill_info_table
    try:
        ready = kv_mgr.try_ensure_parallel_info(bootstrap_addr)
    except RuntimeError as e:
        # Upstream's own checks (page size, KV dtype/layout, TP/DCP layouts) raise here: a
        # refusal, not a reason to stop the decode scheduler. Our comparison names every
        # differing field when the prefill published its settings; else upstream's message.
        message = _check(queue, bootstrap_addr, _fetch_info(bootstrap_addr)) or (
            f"pdsafe: this decode server refuses to pair with the prefill at "
            f"{bootstrap_addr}: {e}")
        return None if _refuse(queue, bootstrap_addr, message, decode_reqs) else False
    if not ready or known:
        return ready
    info = _fetch_info(bootstrap_addr)  # once per prefill: the settings upstream omits
    if info is None:  # not compared yet: never pair unchecked, ask again next round
        kv_mgr.prefill_info_table.pop(bootstrap_addr, None)
        return False
    _remember_published(kv_mgr, bootstrap_addr, info)  # whom peer_capability announces to
    message = _check(queue, bootstrap_addr, info)
    if message is None:
        return True
    kv_mgr.prefill_info_table.pop(bootstrap_addr, None)  # fetched again after RECHECK_S
    return None if _refuse(queue, bootstrap_addr, message, decode_reqs) else False
