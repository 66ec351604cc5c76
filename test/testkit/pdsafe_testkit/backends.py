"""The KV transfer backends the harness and the tests run (the one definition of the list).

Both run on CPU over loopback (see ``loopback.transport_pins``); tests parametrize over this
tuple, and ``KVPair`` refuses any other backend.
"""

from __future__ import annotations

BACKENDS: tuple[str, ...] = ("mooncake", "nixl")
