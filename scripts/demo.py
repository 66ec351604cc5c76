#!/usr/bin/env python3
"""Main job: a CPU PD pair + router on the tiny model, one request, compared to co-located.

  .venv/bin/python scripts/demo.py [--backend mooncake|nixl] [--prompt-len N] [--max-new N]

Starts a co-located reference server, a prefill and a decode server (real transfer backend on
loopback) and the smg PD router, sends one greedy request through the router, and prints both
answers. Exit status 0 only if the PD answer equals the co-located one token for token.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

# The test harness: the test-only distribution test/testkit, which the test profile installs
# (scripts/install-cpu.sh: pip install --no-deps -e test/testkit).
from pdsafe_testkit.oracle import random_prompt
from pdsafe_testkit.servers import (
    DEFAULT_MODEL,
    ServerConfig,
    colocated_server,
    generate,
    new_log_dir,
    pd_stack,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl"])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = Path(args.model)
    logs = new_log_dir("pdsafe-demo-")
    prompt = random_prompt(random.Random(args.seed), args.prompt_len, model)
    t0 = time.monotonic()
    print(f"starting co-located + {args.backend} PD pair + router (logs: {logs}) ...", flush=True)
    with colocated_server(logs, ServerConfig(role="colocated", model_path=model)) as ref, \
            pd_stack(args.backend, logs,
                     prefill=ServerConfig(role="prefill", model_path=model),
                     decode=ServerConfig(role="decode", model_path=model)) as pd:
        print(f"all servers up in {time.monotonic() - t0:.0f}s", flush=True)
        r_ref = generate(ref.url, prompt, args.max_new)
        r_pd = generate(pd.router.url, prompt, args.max_new)
    print(f"prompt ({len(prompt)} tokens): {prompt}")
    print(f"co-located : HTTP {r_ref.status} {r_ref.output_ids}")
    print(f"PD ({args.backend}): HTTP {r_pd.status} {r_pd.output_ids}")
    same = r_ref.ok and r_pd.ok and r_ref.output_ids == r_pd.output_ids
    print("RESULT: IDENTICAL (token for token)" if same else "RESULT: DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
