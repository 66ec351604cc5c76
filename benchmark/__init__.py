"""sglang-pdsafe regression benchmark: content-checked leak matrix and protection overhead.

Run ``python -m benchmark.regression --help`` (docs/benchmark.md). Uses the test-only harness
distribution ``pdsafe_testkit`` (test/testkit) for servers, router, content oracle and metrics;
never imports the server package itself, so it can target a deployment of any build.
"""
