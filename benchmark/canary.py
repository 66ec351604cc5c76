"""Canary prompts: every request's content is drawn from its own small alphabet of tokens.

The tiny model (test/assets/tiny-copy-llama, README "The tiny model") copies the token 16
positions back, so its greedy answer consists of the last 16 prompt tokens, repeated. If a
request decodes over KV that another request wrote, the answer contains that other request's
tokens. To make the owner of such tokens unambiguous, the word tokens of the vocabulary are split
into disjoint alphabets of ``ALPHABET_SIZE`` tokens; each request draws its whole prompt from one
alphabet. A foreign token in an answer therefore names the alphabet, and the ``CanaryBook`` of
the stack names the requests that used that alphabet (most recent first).

Invariants:

* Alphabets are disjoint and never contain special tokens (ids below ``FIRST_WORD``).
* A book hands out alphabets round-robin, so consecutive requests never share one while more
  than ``n_alphabets`` requests separate them; attribution names every request that used the
  alphabet on this stack, so reuse makes it ambiguous, never wrong.
* Tokens of an alphabet no request on this stack has used yet are reported as ``unattributed``
  (uninitialised pages or random garbage), not blamed on anyone.

With a real model (deployment mode) the prompts are still valid token ids; the content oracle
(reference equality) is what decides a leak, attribution is then only a hint.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

FIRST_WORD = 4  # ids 0-3 are <pad> <s> </s> <unk> in the tiny model
ALPHABET_SIZE = 8
COPY_PERIOD = 16  # the tiny model's copy distance (config.json: pdsafe_copy_period)


def n_alphabets(vocab_size: int, size: int = ALPHABET_SIZE) -> int:
    """How many disjoint alphabets the word tokens of a ``vocab_size`` vocabulary hold."""
    return max(0, (vocab_size - FIRST_WORD) // size)


def alphabet(owner: int, size: int = ALPHABET_SIZE) -> range:
    """The token ids of alphabet ``owner``."""
    start = FIRST_WORD + owner * size
    return range(start, start + size)


def owner_of(token: int, vocab_size: int, size: int = ALPHABET_SIZE) -> int | None:
    """The alphabet ``token`` belongs to, or None (special token / outside every alphabet)."""
    if token < FIRST_WORD:
        return None
    k = (token - FIRST_WORD) // size
    return k if k < n_alphabets(vocab_size, size) else None


def canary_prompt(rng: random.Random, owner: int, length: int,
                  size: int = ALPHABET_SIZE) -> list[int]:
    """A prompt of ``length`` tokens drawn from alphabet ``owner`` only.

    The last ``COPY_PERIOD`` positions (what the tiny model copies into its answer) always use
    at least two distinct tokens, so the answer is recognisably this request's."""
    toks = list(alphabet(owner, size))
    out = [rng.choice(toks) for _ in range(length)]
    if length >= 2 and len(set(out[-COPY_PERIOD:])) < 2:
        out[-1] = toks[0] if out[-1] != toks[0] else toks[1]
    return out


@dataclass(frozen=True)
class Attribution:
    """Which requests' content shows up in an answer that is not the reference.

    ``foreign``: label of a request (or ``"alphabet K: A|B"`` when several used it) -> how many
    answer tokens belong to it; ``unattributed``: tokens of no request that ran on this stack;
    ``own``: tokens of the request's own alphabet (in a leak: its own content at the wrong
    positions, e.g. decoded over pages that were never written or hold a shifted copy)."""

    foreign: dict[str, int]
    unattributed: int
    own: int

    @property
    def sources(self) -> list[str]:
        return sorted(self.foreign, key=lambda k: -self.foreign[k])

    def describe(self) -> str:
        parts = [f"{k} x{v}" for k, v in sorted(self.foreign.items(), key=lambda kv: -kv[1])]
        if self.unattributed:
            parts.append(f"unattributed x{self.unattributed}")
        if self.own:
            parts.append(f"own alphabet x{self.own}")
        return ", ".join(parts) or "no tokens"


@dataclass
class CanaryBook:
    """Alphabet assignment and usage record of one PD stack (thread-safe)."""

    vocab_size: int
    size: int = ALPHABET_SIZE
    _next: int = 0
    _users: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def n_owners(self) -> int:
        return n_alphabets(self.vocab_size, self.size)

    def take(self, label: str) -> int:
        """Reserve the next alphabet for request ``label`` and record the use."""
        with self._lock:
            if self.n_owners <= 0:
                raise ValueError(f"vocabulary of {self.vocab_size} tokens has no canary alphabet")
            owner = self._next % self.n_owners
            self._next += 1
            self._users[owner].append(label)
            return owner

    def prompt(self, rng: random.Random, label: str, length: int) -> tuple[int, list[int]]:
        """(alphabet, prompt) of a new canary request ``label``."""
        owner = self.take(label)
        return owner, canary_prompt(rng, owner, length, self.size)

    def users(self, owner: int) -> list[str]:
        with self._lock:
            return list(self._users.get(owner, []))

    def attribute(self, output_ids: Sequence[int], own_owner: int | None) -> Attribution:
        """Name the requests whose alphabets appear in ``output_ids`` (see ``Attribution``)."""
        foreign: dict[str, int] = defaultdict(int)
        unattributed = own = 0
        for tok in output_ids:
            k = owner_of(tok, self.vocab_size, self.size)
            if k is not None and k == own_owner:
                own += 1
                continue
            users = self.users(k) if k is not None else []
            if not users:
                unattributed += 1
            elif len(users) == 1:
                foreign[users[0]] += 1
            else:
                foreign[f"alphabet {k}: " + "|".join(reversed(users[-3:]))] += 1
        return Attribution(dict(foreign), unattributed, own)
