"""What this build is: the fork's version and the upstream base it was built from."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any


@lru_cache(maxsize=1)
def build_info() -> dict[str, Any]:
    """The build record written by build_backend (upstream wheel + sha256, patches applied)."""
    try:
        text = resources.files("sglang.pdsafe").joinpath("_build_info.json").read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return {"version": "unbuilt", "patches": []}
    return json.loads(text)


def version_string() -> str:
    info = build_info()
    return (
        f"sglang-pdsafe {info.get('version')} (upstream {info.get('upstream_wheel', '?')}, "
        f"{len(info.get('patches', []))} patches)"
    )
