"""KV-transfer tests (a package, so that the KV pairs are torn down once these tests end)."""
