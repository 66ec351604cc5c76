"""Test and benchmark harness for sglang-pdsafe (real servers, content oracle, KV harness)."""
