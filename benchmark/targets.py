"""What a scenario runs against: a PD pair (prefill, decode, router) plus the co-located reference.

Two ways to get one:

* the CPU harness (``Harness``): real servers started through ``pdsafe_testkit.servers`` on the
  tiny model, one stack kind (``STACK_KINDS``) per configuration a scenario needs, either
  variant: ``fork`` = the installed package (the venv's sglang), ``base`` = the tree of
  ``base_tree`` (``PYTHONPATH`` per server, ``ServerConfig.env``). Every started server's
  ``/server_info`` ``version`` is checked against the variant (``verify_variant``).
* an existing deployment (``deployment_target``): URLs given on the command line; nothing is
  started, restarted or reconfigured, so only scenarios marked ``deployment_ok`` run there.

Test-only faults (the testkit's plugin, ``pdsafe_testkit.faults``) are armed on harness servers
only, never in deployment mode: the ``late_write`` stack's prefills (``late_write``,
``pdsafe_testkit.late_write``, imported only when that stack starts) and the ``default`` stack's
decode (``kv_corrupt``, ``park_commit``: ``StackKind.decode_faults``); each acts only on requests
whose rid or room is reserved for it, every other request is served normally.

Invariant: a target's ``variant`` is what its servers report: a ``base`` target whose servers
report a ``+pdsafe`` version (or a ``fork`` target whose servers do not) raises
``VariantMismatch`` before any request is judged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import requests

from benchmark import transport
from benchmark.canary import CanaryBook

if TYPE_CHECKING:
    from pdsafe_testkit.late_write import Trio
    from pdsafe_testkit.servers import PDStack

FORK_LABEL = "+pdsafe"
REFERENCE_POOL = 8192


class VariantMismatch(RuntimeError):
    """A server does not run the variant the benchmark believes it runs."""


@dataclass(frozen=True)
class StackKind:
    """One PD configuration, given identically to both variants.

    ``context``: ``"shared"`` gives both legs ``--context-length`` = the smaller pool (the
    configuration the fork accepts: no pool below its context length, and both legs agreeing
    on the context length); ``"per_side"`` gives each leg its own pool as context length (the
    remedy operators used before, with which the legs admit different prompts: the incident's
    divergence); ``contexts``: explicit ``(prefill, decode)`` context lengths, overriding
    ``context``. ``chat_templates``: each leg gets its own ``--chat-template``
    (``chat_template_text(CHAT_SUFFIX[role])``: decode renders 3 tokens more than prefill).
    ``router``: False for stacks whose legs may refuse to pair (the harness's router start
    waits for one successful generation); requests then go to both legs directly, which is
    what the router does. ``decode_faults``: test-only faults armed on the decode (the default
    stack arms ``kv_corrupt`` for the corruption family). ``late_write_trio``: the stack is
    ``pdsafe_testkit.late_write``'s
    (two prefills armed with the test-only ``late_write`` fault, holds ``LATE_HOLDS_S``, one
    decode with upstream's release timeout shortened; pools and context are that module's
    ``PREFILL_POOL`` / ``POOL``, repeated here for the table), no router."""

    name: str
    prefill_pool: int
    decode_pool: int
    auto_truncate: bool = False
    context: str = "shared"
    router: bool = True
    doc: str = ""
    contexts: tuple[int, int] | None = None
    chat_templates: bool = False
    late_write_trio: bool = False
    #: ``SGLANG_PDSAFE_TEST_FAULTS`` for the decode (harness only; each test-only fault acts
    #: only on requests whose rid carries its prefix, every other request is served normally).
    decode_faults: str = ""

    def context_length(self, role: str) -> int:
        if self.contexts is not None:
            return self.contexts[0] if role == "prefill" else self.contexts[1]
        if self.context == "per_side":
            return self.prefill_pool if role == "prefill" else self.decode_pool
        return min(self.prefill_pool, self.decode_pool)


#: Prefill's context length on the ``ctx_div`` stack (decode: 1024, pools 1024): upstream's
#: scheduler limit there is ``min(106 - 1, 1024 - 1) - 5 = 100`` tokens, so a 105-token prompt
#: diverges inside the last partial page at page sizes 16 and 64 (test/pd/test_divergence.py).
CTX_DIV_PREFILL_CONTEXT = 106

#: Token ids each leg's chat template appends after the messages on the ``tpl_div`` stack:
#: word tokens outside every canary alphabet (``canary.owner_of`` is None for them), decode's
#: suffix 3 tokens longer than prefill's, so decode reserves 3 positions prefill never writes.
CHAT_SUFFIX: dict[str, tuple[int, ...]] = {"prefill": (508, 509),
                                           "decode": (508, 509, 510, 511, 508)}

#: How long each prefill of the ``late_write`` stack holds a late room's KV writes (its
#: ``SGLANG_PDSAFE_TEST_FAULTS=late_write:S``): ``held`` past upstream's shortened release
#: timeout (``pdsafe_testkit.late_write.RELEASE_TIMEOUT_S`` = 2 s; the CI test's 6 s), ``other``
#: past decode's abort but within that timeout. late-write-past-release-timeout sends its
#: victim through ``held``, late-write-past-abort through ``other``, each its canary through the
#: other prefill (a traced room: never delayed).
LATE_HOLDS_S: dict[str, float] = {"held": 6.0, "other": 1.0}

#: How long the ``default`` stack's decode parks the finished transfer of a
#: ``pdsafe-fault-park-...`` request before committing it (test-only fault ``park_commit``;
#: abort-after-transfer-before-commit aborts its requests inside that window).
PARK_COMMIT_S = 3.0


def chat_template_text(suffix: tuple[int, ...], words: dict[int, str]) -> str:
    """A Jinja chat template: every message's content followed by a space, then ``suffix``
    (token ids, spelled with the word-level vocabulary ``words``)."""
    return ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            + " ".join(words[t] for t in suffix))


def word_vocab(model_path: Path) -> dict[int, str]:
    """id -> word of a word-level tokenizer (the tiny model's ``tokenizer.json``)."""
    import json

    vocab = json.loads((Path(model_path) / "tokenizer.json").read_text())["model"]["vocab"]
    return {int(i): str(w) for w, i in vocab.items()}


STACK_KINDS: dict[str, StackKind] = {k.name: k for k in (
    StackKind("default", 1024, 1024, decode_faults=f"kv_corrupt,park_commit:{PARK_COMMIT_S:g}",
              doc="equal 1024-token pools and context (the test stack); decode armed with the "
                  "test-only faults SGLANG_PDSAFE_TEST_FAULTS=kv_corrupt,park_commit:"
                  f"{PARK_COMMIT_S:g} (each acts only on its own rids: pdsafe-fault-corrupt-"
                  "MODE-..., pdsafe-fault-park-...)"),
    StackKind("p_lt_d", 320, 1024, doc="prefill pool 320 < decode pool 1024, context 320"),
    StackKind("d_lt_p", 1024, 768, doc="decode pool 768 < prefill pool 1024, context 768"),
    StackKind("p_lt_d_truncate", 320, 1024, True, context="per_side", router=False,
              doc="the incident: prefill pool 320 < decode pool 1024, each leg's context its "
                  "pool, --allow-auto-truncate on both; requests sent to both legs directly"),
    StackKind("ctx_div", 1024, 1024, True, router=False,
              contexts=(CTX_DIV_PREFILL_CONTEXT, 1024),
              doc=f"equal 1024-token pools, prefill --context-length {CTX_DIV_PREFILL_CONTEXT}, "
                  "decode 1024, --allow-auto-truncate on both; requests sent to both legs "
                  "directly"),
    StackKind("tpl_div", 1024, 1024, router=False, chat_templates=True,
              doc="equal 1024-token pools and context, each leg its own --chat-template "
                  "(decode's renders 3 tokens more); requests sent to both legs directly"),
    StackKind("late_write", 8192, 4096, router=False, contexts=(4096, 4096),
              late_write_trio=True,
              doc="pdsafe_testkit.late_write's stack: two prefills (pool 8192, one chunk per "
                  "prompt) armed with the test-only fault SGLANG_PDSAFE_TEST_FAULTS="
                  f"late_write:{LATE_HOLDS_S['held']:g} and late_write:"
                  f"{LATE_HOLDS_S['other']:g}, one decode (pool 4096 = context, "
                  "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=2, heartbeat 1 s x 2, "
                  "--skip-server-warmup); requests sent to the legs directly"),
)}


def server_info(url: str) -> dict[str, Any]:
    return transport.get(url + "/server_info", timeout=30).json()


def model_info(url: str) -> dict[str, Any]:
    try:
        return transport.get(url + "/model_info", timeout=30).json()
    except (requests.RequestException, ValueError):
        return {}


def variant_of(version: str) -> str:
    """``fork`` for an sglang-pdsafe version label, ``base`` for anything else."""
    return "fork" if FORK_LABEL in version else "base"


def verify_variant(urls: dict[str, str], expected: str) -> dict[str, str]:
    """``{role: version}`` of the servers; raise ``VariantMismatch`` unless all run ``expected``."""
    versions = {role: str(server_info(u).get("version")) for role, u in urls.items()}
    wrong = {r: v for r, v in versions.items() if variant_of(v) != expected}
    if wrong:
        raise VariantMismatch(f"expected {expected} servers, got versions {versions}")
    return versions


@dataclass(frozen=True)
class SideLimits:
    """The prompt limits of one server: what it advertises (sglang-pdsafe's ``/model_info``
    ``max_prompt_tokens``) and upstream's own (``max_req_input_len - 1`` by upstream's formula
    ``min(context_length - 1, kv_capacity - 1) - 5``: the longest prompt a stock scheduler
    admits, computed the same way for both variants)."""

    context_length: int | None
    kv_capacity: int | None
    upstream_max_prompt: int | None
    advertised_max_prompt: int | None

    @property
    def effective(self) -> int | None:
        return self.advertised_max_prompt or self.upstream_max_prompt


def side_limits(url: str) -> SideLimits:
    si = server_info(url)
    mi = model_info(url)
    ctx = si.get("context_length") or mi.get("context_length")
    cap = si.get("max_total_num_tokens")
    # Upstream's own formula (tp_worker), from the configuration: the same number for both
    # variants (the fork's /server_info max_req_input_len already carries its corrections).
    if isinstance(ctx, int) and isinstance(cap, int):
        mril = min(ctx - 1, cap - 1) - 5
    else:
        mril = si.get("max_req_input_len")
    adv = mi.get("max_prompt_tokens")
    return SideLimits(ctx if isinstance(ctx, int) else None, cap if isinstance(cap, int) else None,
                      mril - 1 if isinstance(mril, int) else None,
                      adv if isinstance(adv, int) else None)


@dataclass
class PDTarget:
    """A PD pair under test and everything a scenario needs to talk to it."""

    variant: str
    backend: str
    page_size: int
    kind: str
    prefill_url: str
    decode_url: str
    router_url: str | None
    bootstrap_host: str
    bootstrap_port: int
    versions: dict[str, str]
    book: CanaryBook
    stack: PDStack | None = None
    notes: list[str] = field(default_factory=list)
    #: The ``late_write`` stack's servers (harness only); ``prefill_url`` is then its ``other``
    #: prefill, and ``down``/``logs`` cover all three servers.
    trio: Trio | None = None
    #: Roles a scenario killed on purpose (``crash-prefill-mid-transfer``): still reported by
    #: ``down`` (the stack must be restarted before another scenario), but not a crash.
    killed: set[str] = field(default_factory=set)
    #: Further prefill and decode instances behind the router (deployment mode; roles
    #: ``prefill-2``, ``decode-2``, ...). Requests sent to the legs directly go to the first
    #: pair (``prefill_url``, ``decode_url``); evidence, limits and health cover them all.
    extra_prefills: list[str] = field(default_factory=list)
    extra_decodes: list[str] = field(default_factory=list)

    def words(self) -> dict[int, str]:
        """id -> word of the served model's word-level vocabulary (harness targets only: the
        tiny model; chat scenarios spell canary token ids with it)."""
        if self.stack is None:
            raise RuntimeError("word vocabulary is known only for harness stacks")
        return word_vocab(self.stack.decode.config.model_path)

    def served_model(self) -> str:
        """The model id decode serves (``/v1/models``), for OpenAI-style requests."""
        data = transport.get(self.decode_url + "/v1/models", timeout=30).json()
        return str(data["data"][0]["id"])

    def limits(self) -> dict[str, SideLimits]:
        """Each prefill's and decode's prompt limits, by role (``prefill``, ``prefill-2``...;
        a ``late_write`` stack: the pair that takes direct requests)."""
        if self.trio is not None:
            return {"prefill": side_limits(self.prefill_url),
                    "decode": side_limits(self.decode_url)}
        return {role: side_limits(u) for role, u in self.urls().items()
                if role.startswith(("prefill", "decode"))}

    def urls(self) -> dict[str, str]:
        """Role -> URL of every server of the target (the reference not included)."""
        if self.trio is not None:
            return {role: s.url for role, s in self.trio.servers().items()}
        urls = _roles("prefill", [self.prefill_url, *self.extra_prefills])
        urls.update(_roles("decode", [self.decode_url, *self.extra_decodes]))
        if self.router_url:
            urls["router"] = self.router_url
        return urls

    def live_prefill_urls(self) -> list[str]:
        """The prefills not killed on purpose (every prefill of a ``late_write`` stack)."""
        return [u for role, u in self.urls().items()
                if role.startswith("prefill") and role not in self.killed]

    def live_decode_urls(self) -> list[str]:
        return [u for role, u in self.urls().items()
                if role.startswith("decode") and role not in self.killed]

    def counter_urls(self) -> tuple[list[str], list[str]]:
        """(prefills, decodes) whose transfer counters prove a phase's transfers: every
        instance behind the router (a ``late_write`` stack: its ``other`` prefill only; its
        scenarios name the prefills they read themselves)."""
        return ([self.prefill_url, *self.extra_prefills],
                [self.decode_url, *self.extra_decodes])

    def down(self) -> list[str]:
        """The roles (prefill, decode, router; ``prefill-held``, ``prefill-other``, decode on a
        ``late_write`` stack) whose /health does not answer 200 now."""
        out = []
        for role, u in self.urls().items():
            try:
                if transport.get(u + "/health", timeout=10).status_code != 200:
                    out.append(role)
            except requests.RequestException:
                out.append(role)
        return out

    def healthy(self) -> bool:
        return not self.down()

    def logs(self) -> dict[str, str]:
        if self.trio is not None:
            return {role: str(s.process.log_path) for role, s in self.trio.servers().items()}
        if self.stack is None:
            return {}
        out = {"prefill": str(self.stack.prefill.process.log_path),
               "decode": str(self.stack.decode.process.log_path)}
        if self.stack.router is not None:
            out["router"] = str(self.stack.router.process.log_path)
        return out

    def describe(self) -> dict[str, Any]:
        return {"variant": self.variant, "backend": self.backend, "page_size": self.page_size,
                "kind": self.kind, "prefill": self.prefill_url, "decode": self.decode_url,
                "extra_prefills": self.extra_prefills, "extra_decodes": self.extra_decodes,
                "router": self.router_url, "versions": self.versions, "logs": self.logs()}


def _roles(role: str, urls: list[str]) -> dict[str, str]:
    """``{"prefill": u1, "prefill-2": u2, ...}``."""
    return {(role if i == 0 else f"{role}-{i + 1}"): u for i, u in enumerate(urls)}


def deployment_target(prefills: str | list[str], decodes: str | list[str], router: str | None,
                      *, bootstrap_host: str | None = None, label: str | None = None,
                      vocab: int | None = None) -> PDTarget:
    """A target for an existing deployment (nothing started): one or several prefill and
    decode instances (``prefills[0]`` / ``decodes[0]`` take the requests sent to the legs
    directly). Backend, page size, bootstrap port and the variant label come from the first
    prefill's and decode's ``/server_info``; the preflight (``benchmark.preflight``) checks
    that every instance agrees."""
    ps = [u.rstrip("/") for u in ([prefills] if isinstance(prefills, str) else prefills)]
    ds = [u.rstrip("/") for u in ([decodes] if isinstance(decodes, str) else decodes)]
    if not ps or not ds:
        raise ValueError("a deployment needs at least one prefill and one decode URL")
    pi, di = server_info(ps[0]), server_info(ds[0])
    port = pi.get("disaggregation_bootstrap_port")
    if not isinstance(port, int):
        raise ValueError(f"{ps[0]}/server_info has no disaggregation_bootstrap_port "
                         f"(is it a prefill server?): mode {pi.get('disaggregation_mode')}")
    host = bootstrap_host or urlparse(ps[0]).hostname or "127.0.0.1"
    versions = {"prefill": str(pi.get("version")), "decode": str(di.get("version"))}
    variant = label or variant_of(versions["decode"])
    if vocab is None:
        vocab = _vocab_of(di)
    return PDTarget(variant, str(pi.get("disaggregation_transfer_backend")),
                    int(pi.get("page_size") or 1), "deployed", ps[0], ds[0],
                    router.rstrip("/") if router else None, host, port, versions,
                    CanaryBook(vocab), extra_prefills=ps[1:], extra_decodes=ds[1:])


def _vocab_of(info: dict[str, Any]) -> int:
    """The served model's vocabulary size: from its config.json when the model path is readable
    here (same machine or shared storage), else 32000 (token ids below any common vocabulary)."""
    import json

    for key in ("model_path", "tokenizer_path"):
        cfg = Path(str(info.get(key) or "")) / "config.json"
        try:
            return int(json.loads(cfg.read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return 32000


def wait_until(pred, timeout: float, poll: float = 0.5) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(poll)
    return pred()


__all__ = ["CHAT_SUFFIX", "CTX_DIV_PREFILL_CONTEXT", "LATE_HOLDS_S", "PARK_COMMIT_S",
           "STACK_KINDS", "PDTarget", "SideLimits", "StackKind", "VariantMismatch",
           "chat_template_text", "deployment_target", "side_limits", "variant_of",
           "verify_variant", "word_vocab"]
