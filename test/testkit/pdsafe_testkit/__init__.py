"""Test and benchmark harness for sglang-pdsafe (real servers, content oracle, KV harness).

A test-only distribution (``sglang-pdsafe-testkit``), installed editable by the test profile;
``test/`` and ``benchmark/`` import it as ``pdsafe_testkit`` without any path manipulation.
Importing this package (and its parent-side modules) never imports sglang.
"""
