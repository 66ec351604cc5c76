"""Every error text docs/operator-guide.md quotes under "What clients see" is text the code
produces (issue 22, item 4: "error texts quoted in the docs checked against the code").

Sources: the string expressions (literals, f-strings, ``+`` chains; module constants filled in,
every other value a hole) of the installed ``sglang.pdsafe`` modules and of the upstream files
a PD request's errors come from (``sglang/srt/disaggregation``, ``managers``, ``entrypoints``
of the installed, patched sglang). A quoted text is split at its placeholders (``...``, ``…``
and the one-letter names ``N``, ``M``, ``R``, ``G``, ``K``, ``X``, ``Y``); every remaining
fragment must appear inside the literal text of one code string, and the first fragment must
start one. A message composed of two strings (a reason inside a prefix) passes when each part
is found; a text the code never produces (a made-up prefix) fails.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import lru_cache
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operator-guide.md"
HOLE = "\x00"
PLACEHOLDER = re.compile(r"\.\.\.|…|\b[NMRGKXY]\b")
UPSTREAM_DIRS = ("disaggregation", "managers", "entrypoints")
#: Fragments shorter than this (punctuation, "=", ", room ") say nothing on their own.
MIN_FRAGMENT = 5


def _value(mod: ModuleType | None, node: ast.expr) -> object:
    if mod is None:
        return None
    if isinstance(node, ast.Name):
        return getattr(mod, node.id, None)
    if isinstance(node, ast.Attribute):
        base = _value(mod, node.value)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def _skeleton(mod: ModuleType | None, node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        out = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                out.append(str(v.value))
                continue
            c = _value(mod, v.value) if v.format_spec is None else None  # type: ignore[attr-defined]
            if isinstance(c, (str, int)) and not isinstance(c, bool):
                out.append(repr(c) if v.conversion == ord("r") else str(c))  # type: ignore[attr-defined]
            else:
                out.append(HOLE)
        return "".join(out)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _skeleton(mod, node.left), _skeleton(mod, node.right)
        if left is None and right is None:
            return None
        return (left if left is not None else HOLE) + (right if right is not None else HOLE)
    return None


def _parse(source: str) -> ast.Module:
    """``ast.parse``, once more after CPython 3.11's spurious ``SystemError: AST constructor
    recursion depth mismatch`` (a process-global counter that another thread's AST work can
    leave off: CPython gh-106905; seen once in this suite, 2026-12-07)."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)


def _strings(path: Path, mod: ModuleType | None) -> list[str]:
    tree = _parse(path.read_text())
    return [s for node in ast.walk(tree)
            if isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp))
            and (s := _skeleton(mod, node)) is not None and len(s) >= MIN_FRAGMENT]


@lru_cache(maxsize=1)
def code_strings() -> tuple[str, ...]:
    import sglang
    import sglang.pdsafe

    out: list[str] = []
    for f in sorted(Path(sglang.pdsafe.__file__).parent.glob("*.py")):
        mod = importlib.import_module(f"sglang.pdsafe.{f.stem}") if f.stem != "__init__" else None
        out += _strings(f, mod)
    srt = Path(sglang.__file__).parent / "srt"
    for d in UPSTREAM_DIRS:
        for f in sorted((srt / d).rglob("*.py")):
            out += _strings(f, None)  # upstream: literals only, no import needed
    return tuple(out)


def quoted_messages() -> list[str]:
    section = GUIDE.read_text().split("## What clients see", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = line.strip().strip("|").split(" | ")
        if line.startswith("| ") and len(cells) >= 3 and not set(cells[0]) <= {"-"}:
            out += re.findall(r"`([^`]+)`", cells[1])
    return out


def fragments(quote: str) -> tuple[str | None, list[str]]:
    """(the quote's opening text, when it opens with literal text; every literal fragment)."""
    parts = [p.strip(" ,.:;()'\"") for p in PLACEHOLDER.split(quote)]
    frags = [p for p in parts if len(p) >= MIN_FRAGMENT]
    opening = parts[0] if parts and len(parts[0]) >= MIN_FRAGMENT else None
    return opening, frags


def _found(fragment: str, strings: tuple[str, ...], *, start: bool) -> bool:
    for s in strings:
        for run in s.split(HOLE):
            if (run.lstrip().startswith(fragment) if start else fragment in run):
                return True
    return False


def test_the_section_quotes_messages():
    assert len(quoted_messages()) >= 15, quoted_messages()


def test_every_quoted_message_is_produced_by_the_code():
    strings = code_strings()
    bad = []
    for q in quoted_messages():
        opening, frags = fragments(q)
        if not frags:
            bad.append((q, "no literal text to check"))
            continue
        if opening is not None and not _found(opening, strings, start=True):
            bad.append((q, f"no code message starts with {opening!r}"))
        bad += [(q, f"no code string contains {f!r}") for f in frags
                if not _found(f, strings, start=False)]
    assert not bad, "texts the guide quotes that the code does not produce:\n" + "\n".join(
        f"  {q!r}: {why}" for q, why in bad)


def test_a_made_up_text_is_caught():
    strings = code_strings()
    assert not _found("pdsafe coverage:", strings, start=True)
    assert _found("KV coverage mismatch for request", strings, start=True)
