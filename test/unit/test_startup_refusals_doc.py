"""docs/startup-refusals.md lists every message with which a server refuses to start, and only
those (issue 22, item 4: "a table of startup refusals with their messages and remedies").

The refusals are found in the code, not in a hand-kept list: every ``raise`` whose message has
literal text (``ast``), in

* a function that is the body of a startup hook (``policy.HOOKS`` entries whose ``on_failure``
  is ``policy.reraise_at_startup``: their exception refuses the start), or a pdsafe function
  such a body calls directly, by name, within the package (one level: the setting parsers,
  the self-check, the fake-transfer check);
* or raising a type that *is* a refused start wherever it is raised
  (``policy.StartupRefusedError`` and its subclasses, ``hook_api.HookAPIError``,
  ``startup.FakeTransferRefusedError``).

Each message becomes a skeleton: literal text, module constants filled in (an environment
variable's name, a flag), every other value a ``…``. The table's message column quotes the
start of a skeleton in backquotes; the test asserts that every skeleton is quoted by exactly one
row and that every quoted start belongs to exactly one skeleton, so a new refusal, a reworded
one or a stale row fails here.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "python" / "sglang" / "pdsafe"
DOC = REPO / "docs" / "startup-refusals.md"
HOLE = "…"
#: A quoted start shorter than this could not tell two refusals apart.
MIN_QUOTE = 24
#: Raise sites the rules above find that are not a refusal an operator sees at startup.
NOT_A_STARTUP_REFUSAL: dict[tuple[str, str], str] = {
    ("page_generation", "_parts"): "its reason is embedded in install's refusal (the '…' after "
                                   "'uses what they do not cover:')",
    ("coverage", "aux_rows"): "its reason is embedded in check_aux_buffers' refusal (the '…' "
                              "after 'refuses to start:')",
}


@dataclass(frozen=True)
class Site:
    module: str
    function: str
    line: int
    skeleton: str


def _value(mod: ModuleType, node: ast.expr) -> Any:
    """A module-level name or dotted attribute's value (an imported module's constant)."""
    if isinstance(node, ast.Name):
        return getattr(mod, node.id, None)
    if isinstance(node, ast.Attribute):
        base = _value(mod, node.value)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def _constant(mod: ModuleType, node: ast.expr) -> str | None:
    v = _value(mod, node)
    if isinstance(v, (str, int, float)) and not isinstance(v, bool):
        return str(v)
    return None


def skeleton(mod: ModuleType, node: ast.expr) -> str:
    """The message ``node`` builds: literals kept, module constants filled in, else ``…``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
                continue
            assert isinstance(v, ast.FormattedValue)
            c = _constant(mod, v.value) if v.format_spec is None else None
            if c is None:
                parts.append(HOLE)
            else:
                parts.append(repr(_value(mod, v.value)) if v.conversion == ord("r") else c)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return skeleton(mod, node.left) + skeleton(mod, node.right)
    if isinstance(node, ast.IfExp):
        return HOLE
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        built = _builder_return(mod, node.func.id)
        if built is not None:  # a module function that builds the message (pure, quotable)
            return skeleton(mod, built)
    c = _constant(mod, node)
    return c if c is not None else HOLE


@functools.cache
def _parsed(path: str) -> ast.Module:
    """A module's syntax tree, parsed once per file."""
    return ast.parse(Path(path).read_text())


def _builder_return(mod: ModuleType, name: str) -> ast.expr | None:
    """The returned expression of ``mod``'s top-level function ``name`` when its body is a
    docstring and one ``return`` (a message builder such as ``admission.capacity_refusal``)."""
    for node in _parsed(mod.__file__).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            body = [b for b in node.body if not (isinstance(b, ast.Expr)
                                                 and isinstance(b.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value:
                return body[0].value
    return None


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node  # type: ignore[misc]


def _raises(fn: ast.AST) -> Iterator[ast.Raise]:
    for node in ast.walk(fn):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            yield node


def _called(mod: ModuleType, fn: ast.FunctionDef) -> Iterator[tuple[str, str]]:
    """(module stem, function) of the pdsafe functions ``fn``'s body calls by name."""
    for node in (n for stmt in fn.body for n in ast.walk(stmt)):
        if not isinstance(node, ast.Call):
            continue
        target = _value(mod, node.func)
        name = getattr(target, "__name__", None)
        owner = getattr(target, "__module__", "") or ""
        if name and owner.startswith("sglang.pdsafe."):
            body = getattr(target, "__pdsafe_hook__", None)
            if body is not None:  # a hook: the function behind its guard
                name = body.body.__name__
            yield owner.rsplit(".", 1)[1], name


def _startup_types() -> tuple[type, ...]:
    from sglang.pdsafe import hook_api, policy, startup

    return (policy.StartupRefusedError, hook_api.HookAPIError,
            startup.FakeTransferRefusedError)


def refusal_sites() -> list[Site]:
    from sglang.pdsafe import policy, startup

    for name in startup.HOOK_MODULES:
        importlib.import_module(name)
    roots = {(s.body.__module__.rsplit(".", 1)[1], s.body.__name__)
             for s in policy.HOOKS.values() if s.on_failure is policy.reraise_at_startup}
    mods = {f.stem: importlib.import_module(f"sglang.pdsafe.{f.stem}")
            for f in PKG.glob("*.py") if f.stem != "__init__"}
    trees = {stem: _parsed(str(PKG / f"{stem}.py")) for stem in mods}
    fns = {(stem, n): fn for stem, tree in trees.items() for n, fn in _functions(tree)}
    reached, todo = set(roots), list(roots)
    while todo:  # everything a startup hook's body calls, transitively, within the package
        key = todo.pop()
        for c in _called(mods[key[0]], fns[key]):
            if c in fns and c not in reached:
                reached.add(c)
                todo.append(c)
    types = _startup_types()
    sites = []
    for (stem, fname), fn in fns.items():
        for r in _raises(fn):
            exc_type = _value(mods[stem], r.exc.func)  # type: ignore[union-attr]
            is_type = isinstance(exc_type, type) and issubclass(exc_type, types)
            if (stem, fname) not in reached and not is_type:
                continue
            if (stem, fname) in NOT_A_STARTUP_REFUSAL:
                continue
            text = skeleton(mods[stem], r.exc.args[0])  # type: ignore[union-attr]
            if len(text.replace(HOLE, "").strip()) < MIN_QUOTE:
                continue  # a wrapper re-raising another message (no text of its own)
            sites.append(Site(stem, fname, r.lineno, text))
    return sites


def _norm(text: str) -> str:
    return " ".join(text.replace("...", HOLE).split())


def quoted_starts() -> list[str]:
    """The backquoted starts in the message column of the doc's table."""
    out = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if not line.startswith("| ") or len(cells) < 3 or set(cells[0]) <= {"-", "|"}:
            continue
        out += re.findall(r"`([^`]+)`", cells[1])
    return out


def test_the_scan_finds_the_known_refusals():
    texts = [s.skeleton for s in refusal_sites()]
    for start in ("pdsafe: refusing to start this … server: its KV pool holds",
                  "pdsafe: the installed upstream lacks members",
                  "sglang-pdsafe: this … server was started with --disaggregation-transfer",
                  "pdsafe page generations: this PD … server uses what they do not cover",
                  "SGLANG_PDSAFE_POISON_AFTER=… is not an integer"):
        assert any(_norm(t).startswith(start) for t in texts), (start, texts)


def test_every_startup_refusal_is_in_the_table_and_the_reverse():
    sites = refusal_sites()
    quotes = [q for q in quoted_starts() if q.strip()]
    assert quotes, f"{DOC} has no quoted message in its table"
    short = [q for q in quotes if len(_norm(q)) < MIN_QUOTE]
    assert not short, f"quoted starts too short to tell refusals apart: {short}"
    for q in quotes:
        hits = [s for s in sites if _norm(s.skeleton).startswith(_norm(q))]
        assert len(hits) == 1, (
            f"the table quotes {q!r}, which starts {len(hits)} refusal messages of the code "
            f"(need exactly 1): {[(s.module, s.function, s.line) for s in hits]}")
    for s in sites:
        rows = [q for q in quotes if _norm(s.skeleton).startswith(_norm(q))]
        assert len(rows) == 1, (
            f"{s.module}.{s.function} (line {s.line}) refuses the start with "
            f"{_norm(s.skeleton)[:160]!r}: quoted by {len(rows)} rows of {DOC.name} (need 1)")


def test_the_exclusions_still_exist():
    for stem, fname in NOT_A_STARTUP_REFUSAL:
        tree = _parsed(str(PKG / f"{stem}.py"))
        assert fname in dict(_functions(tree)), f"stale exclusion {stem}.{fname}"
