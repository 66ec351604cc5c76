"""Unit tests that start no server (a package, so that their basenames may repeat the server
tests' ones, e.g. test/pd/test_x.py and test/unit/test_x.py)."""
