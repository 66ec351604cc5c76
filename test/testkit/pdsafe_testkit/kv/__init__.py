"""A model-free KV transfer harness: the REAL sglang Mooncake/NIXL managers in two processes.

Modules, by concern (the parent side never imports torch or sglang):

* ``pages``: page-content encoding and classification (pure numpy);
* ``layouts``: the slot byte patterns of the MLA and DSA pool kinds (pure numpy);
* ``results``: poll-state names, ``AbortAt``, ``SideOutcome``, ``TransferResult``;
* ``rpc``: the spawned children and their command pipes (``Child``, ``HarnessError``);
* ``pair``: ``KVPair`` / ``KVLane``, what tests use;
* ``child`` (child process entry point) and ``scheduler_glue`` (the real KV classes driven as
  the schedulers drive them): run in the children, where sglang is imported.
"""

from __future__ import annotations

from pdsafe_testkit.backends import BACKENDS
from pdsafe_testkit.kv.child import kv_child_env, write_stub_model_config
from pdsafe_testkit.kv.layouts import COMPONENTS, POOL_KINDS, RowCopy
from pdsafe_testkit.kv.pages import (
    BitFlip,
    BufferVerdict,
    PageKind,
    PageVerdict,
    apply_bit_flip,
    classify_pages,
    encode_rows,
    fill_data_pages,
    fill_poison_pages,
    fill_stale_pages,
    request_token_ids,
)
from pdsafe_testkit.kv.pair import KVLane, KVPair
from pdsafe_testkit.kv.results import KVPOLL_NAMES, AbortAt, SideOutcome, TransferResult
from pdsafe_testkit.kv.rpc import HarnessError

__all__ = [
    "BACKENDS",
    "COMPONENTS",
    "KVPOLL_NAMES",
    "AbortAt",
    "BitFlip",
    "BufferVerdict",
    "HarnessError",
    "KVLane",
    "KVPair",
    "PageKind",
    "PageVerdict",
    "POOL_KINDS",
    "RowCopy",
    "SideOutcome",
    "TransferResult",
    "apply_bit_flip",
    "classify_pages",
    "encode_rows",
    "fill_data_pages",
    "fill_poison_pages",
    "fill_stale_pages",
    "kv_child_env",
    "request_token_ids",
    "write_stub_model_config",
]
