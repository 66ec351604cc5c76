"""The KV mismatch breaker (``sglang.pdsafe.kv_breaker``): its setting and its one transition.

The wiring through decode's real patched check is in ``test_kv_integrity_wiring.py``.
"""

from __future__ import annotations

import pytest
from sglang.pdsafe import kv_breaker
from sglang.pdsafe.kv_breaker import Breaker, Setting


def test_setting_is_off_unless_given_and_validated():
    for off in (None, "", "0", "off"):
        assert kv_breaker.parse(off) is None
    assert kv_breaker.parse("3/600") == Setting(3, 600.0)
    assert kv_breaker.parse(" 1/0.5 ") == Setting(1, 0.5)
    for bad in ("3", "3/", "/60", "0/60", "3/0", "3/-1", "x/60", "3/y"):
        with pytest.raises(ValueError, match=kv_breaker.ENV):
            kv_breaker.parse(bad)


def test_opens_at_n_within_the_window_and_never_closes():
    b = Breaker(Setting(3, 10.0))
    assert not b.note(1, 0.0) and not b.note(1, 5.0)
    assert not b.note(1, 11.0)  # the first fell out of the window: 2 in the last 10 s
    assert b.note(1, 14.0) and b.opened_at == 14.0  # 5, 11, 14
    assert not b.note(5, 100.0) and b.opened_at == 14.0  # open stays open, opens once
    assert not Breaker(Setting(2, 1.0)).note(0, 0.0)
    assert Breaker(Setting(2, 1.0)).note(2, 0.0)  # two in one batch


def test_process_breaker_reads_the_environment_once(monkeypatch):
    monkeypatch.setenv(kv_breaker.ENV, "1/60")
    kv_breaker.reset_for_tests()
    try:
        assert kv_breaker.refusal_message() is None
        kv_breaker.note_mismatches(0)
        assert kv_breaker.refusal_message() is None
        kv_breaker.note_mismatches(1, now=1.0)
        msg = kv_breaker.refusal_message()
        assert msg is not None and msg.startswith(kv_breaker.MARKER)
        monkeypatch.setenv(kv_breaker.ENV, "off")  # read once: a restart is what closes it
        assert kv_breaker.refusal_message() == msg
    finally:
        monkeypatch.delenv(kv_breaker.ENV)
        kv_breaker.reset_for_tests()
    assert kv_breaker.breaker() is None
