"""The failure-policy table: ``docs/failure-policy.md``, generated from the code.

``scripts/pdsafe-patches failure-policy [--check] [--out PATH] [--patches DIR]`` (run with the
project venv's python) builds it from two sources:

* **the patch series**: the series is applied to the pinned, sha256-verified upstream wheel
  (only the files it touches are unpacked), and every line a patch adds (``+``) is found in
  the patched file; the file's syntax tree names every use of our code on those lines and the
  upstream function it sits in. Our code is reached through the names the patches import
  (``from sglang.pdsafe import m as pdsafe_m``, ``from sglang.pdsafe.m import f as g``,
  ``import sglang.pdsafe.m``) and through the attributes in :data:`PDSAFE_ATTRIBUTES`
  (``allocator.pdsafe_page_generations.freed(...)``). Reads of constants
  (``pdsafe_peer_capability.ANNOUNCE_TAG``) are not calls. The ``pdsafe_*`` methods the
  patches add to upstream classes are upstream-side functions: calls inside them are "called
  from that method", and the table lists who calls each method (upstream sites, pdsafe
  modules);
* **the registry**: every module of ``sglang.pdsafe.startup.HOOK_MODULES`` is imported and
  ``policy.HOOKS`` (one :class:`~sglang.pdsafe.policy.HookSpec` per hook) and
  ``policy.PASSTHROUGH`` are read. A call maps to a hook by the function object it reaches
  (so a re-export, ``peer_release.decode_rejected`` of ``peer_notifier.decode_rejected``, maps
  to its hook), or, for a method whose whole body is ``return <hook>(...)``, to that hook
  (``GenerationTable.freed`` -> ``page_generation.freed``).

``--check`` fails (exit 1, one line per problem) when the document differs from what would be
generated, a patch calls a function of ours that is neither a hook nor a passthrough, a hook
has no call site in any patch and is not marked pdsafe-internal (``HookSpec.internal``), a
hook's counter is not declared in ``metrics.COUNTERS``, a declared passthrough is called by
no patch, or the installed ``sglang.pdsafe`` modules are not this repository's.

Invariant: the output depends only on the patch series, the pinned base and our modules (no
time, no host, sorted everywhere), so ``--check`` compares byte for byte.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "build_backend") not in sys.path:
    sys.path.insert(0, str(ROOT / "build_backend"))
import pdsafe_build as pb  # noqa: E402

DOC = ROOT / "docs" / "failure-policy.md"
MODULES_DIR = ROOT / "python" / "sglang" / "pdsafe"
PACKAGE = "sglang.pdsafe"
COMMAND = ".venv/bin/python scripts/pdsafe-patches failure-policy"
#: Attributes our modules attach to upstream objects, holding an object of ours, by the
#: dotted path of its class: ``x.<attribute>.<method>(...)`` calls that class's method.
PDSAFE_ATTRIBUTES: dict[str, str] = {
    "pdsafe_page_generations": "sglang.pdsafe.page_generation.GenerationTable",
}

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


# =========================================================================== the patches


@dataclass(frozen=True)
class Hunk:
    """One hunk of a patch: its file, the new side's first line and lines (tag, text)."""

    patch: str
    file: str
    new_start: int
    lines: tuple[tuple[str, str], ...]

    @property
    def new_side(self) -> list[str]:
        return [text for tag, text in self.lines if tag in " +"]


def patch_hunks(patch: Path) -> list[Hunk]:
    """Every hunk of a git-format patch, in patch order. A hunk ends when the line counts of
    its header are consumed (a blank line counts as a context line whose space was
    stripped; ``\\ No newline`` markers are skipped)."""
    hunks: list[Hunk] = []
    file: str | None = None
    lines = iter(patch.read_text(errors="replace").splitlines())
    for ln in lines:
        if ln.startswith("diff --git "):
            file = ln.rsplit(" b/", 1)[-1]
            continue
        m = _HUNK_RE.match(ln)
        if not m or file is None:
            continue
        old_left = int(m.group(2)) if m.group(2) is not None else 1
        new_left = int(m.group(4)) if m.group(4) is not None else 1
        body: list[tuple[str, str]] = []
        while old_left > 0 or new_left > 0:
            ln = next(lines, None)
            if ln is None:
                raise pb.BuildError(f"{patch.name}: a hunk of {file} ends early")
            if ln.startswith("\\"):
                continue
            tag, text = (ln[0], ln[1:]) if ln else (" ", "")
            if tag not in " +-":
                raise pb.BuildError(f"{patch.name}: a hunk of {file} has a line {ln!r}")
            old_left -= tag in " -"
            new_left -= tag in " +"
            body.append((tag, text))
        hunks.append(Hunk(patch.name, file, int(m.group(3)), tuple(body)))
    return hunks


def patched_files(series: list[Path], files: Iterable[str]) -> dict[str, str]:
    """The text of ``files`` (repository paths) after the whole series, applied to the files
    unpacked from the pinned upstream wheel (nothing else of the wheel is unpacked)."""
    wheel = pb.fetch_upstream_wheel(pb.load_config(), pb.load_lock())
    wanted = sorted(set(files))
    with tempfile.TemporaryDirectory(prefix="pdsafe-policy-") as tmp:
        tree = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            for rel in wanted:
                member = rel[len("python/"):]
                if member in names:
                    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                    (tree / rel).write_bytes(zf.read(member))
        for patch in series:
            pb.apply_patch(tree, patch)
        return {rel: (tree / rel).read_text() for rel in wanted if (tree / rel).is_file()}


def _added_lines(hunks: list[Hunk], text: str) -> dict[int, str]:
    """Line number (1-based, in ``text``) -> patch name, for every ``+`` line of ``hunks``
    (one file's hunks, series order). Each hunk's new side is found verbatim in the
    patched text (a revert-clean series leaves it intact), nearest to where its header says,
    shifted by what the previous hunk of the same patch was shifted."""
    lines = text.splitlines()
    out: dict[int, str] = {}
    shift: dict[str, int] = {}
    for h in hunks:
        block = h.new_side
        if not block:
            continue
        want = h.new_start - 1 + shift.get(h.patch, 0)
        found = [i for i in range(len(lines) - len(block) + 1)
                 if lines[i] == block[0] and lines[i:i + len(block)] == block]
        if not found:
            raise pb.BuildError(f"{h.patch}: a hunk of {h.file} (+{h.new_start}) is not in the "
                                "patched file: is the series revert-clean (`check`)?")
        at = min(found, key=lambda i: (abs(i - want), i))
        shift[h.patch] = at - (h.new_start - 1)
        n = at
        for tag, _ in h.lines:
            if tag == "-":
                continue
            n += 1
            if tag == "+":
                out[n] = h.patch
    return out


@dataclass(frozen=True)
class Site:
    """One use of our code on a line a patch added: ``target`` is the dotted path it names
    (``sglang.pdsafe.m.f``, ``sglang.pdsafe.m.Class.method``); ``scope`` the upstream
    function it sits in (``Class.method``; ``<module>`` at module level)."""

    patch: str
    file: str
    line: int
    scope: str
    target: str
    call: bool

    @property
    def where(self) -> str:
        return f"{self.patch[:4]} {self.file}:{self.line} {self.scope}"


@dataclass(frozen=True)
class MethodDef:
    """A ``pdsafe_*`` method a patch adds to an upstream class."""

    patch: str
    file: str
    cls: str
    name: str


@dataclass
class Scan:
    """What the patches' added lines do with our code."""

    sites: list[Site] = field(default_factory=list)
    methods: list[MethodDef] = field(default_factory=list)
    method_calls: list[tuple[str, str, str, str]] = field(default_factory=list)  # name, ...
    unknown: list[str] = field(default_factory=list)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted path, for every import of our package anywhere in the file."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PACKAGE + ".") and a.asname:
                    out[a.asname] = a.name
    return out


class _Scanner(ast.NodeVisitor):
    """Collects the :class:`Site` s of one patched file (see :func:`scan`)."""

    def __init__(self, file: str, added: dict[int, str], aliases: dict[str, str],
                 scan: Scan) -> None:
        self.file, self.added, self.aliases, self.scan = file, added, aliases, scan
        self.stack: list[tuple[str, bool]] = []  # (name, is a class)

    @property
    def scope(self) -> str:
        return ".".join(n for n, _ in self.stack) or "<module>"

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        is_class = isinstance(node, ast.ClassDef)
        if (not is_class and node.name.startswith("pdsafe_") and self.stack
                and self.stack[-1][1] and node.lineno in self.added):
            self.scan.methods.append(MethodDef(self.added[node.lineno], self.file, self.scope,
                                               node.name))
        self.stack.append((node.name, is_class))
        self.generic_visit(node)
        self.stack.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        dotted = _dotted(node.func)
        if dotted is None:
            self.generic_visit(node)
            return
        self._use(dotted, node.func, call=True)
        for child in [*node.args, *node.keywords]:
            self.visit(child)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = _dotted(node)
        if dotted is None:
            self.generic_visit(node)
        else:
            self._use(dotted, node, call=False)

    def visit_Name(self, node: ast.Name) -> None:
        self._use(node.id, node, call=False)

    def _use(self, dotted: str, node: ast.AST, call: bool) -> None:
        line = getattr(node, "end_lineno", None) or node.lineno  # type: ignore[attr-defined]
        patch = self.added.get(line)
        if patch is None:
            return
        parts = dotted.split(".")
        target: str | None = None
        if parts[0] in self.aliases:
            target = ".".join([self.aliases[parts[0]], *parts[1:]])
        elif dotted.startswith(PACKAGE + "."):
            target = dotted
        else:
            held = [i for i, p in enumerate(parts) if i > 0 and p.startswith("pdsafe_")]
            if not held or not call:
                return
            i = held[-1]
            if i == len(parts) - 1:  # x.pdsafe_method(...): a method a patch added
                self.scan.method_calls.append((parts[-1], self.file, self.scope, patch))
                return
            if parts[i] not in PDSAFE_ATTRIBUTES:
                self.scan.unknown.append(
                    f"{patch[:4]} {self.file}:{line} {self.scope}: calls {dotted}(...), and "
                    f"{parts[i]} is not an attribute of ours (PDSAFE_ATTRIBUTES in "
                    "scripts/failure_policy.py)")
                return
            target = ".".join([PDSAFE_ATTRIBUTES[parts[i]], *parts[i + 1:]])
        self.scan.sites.append(Site(patch, self.file, line, self.scope, target, call))


def scan(patches_dir: Path) -> Scan:
    """Every use of our code on the lines the series adds (no sglang import)."""
    series = pb.read_series(patches_dir.resolve())
    by_file: dict[str, list[Hunk]] = {}
    for patch in series:
        for h in patch_hunks(patch):
            by_file.setdefault(h.file, []).append(h)
    texts = patched_files(series, by_file)
    out = Scan()
    for rel in sorted(by_file):
        if not rel.endswith(".py") or rel not in texts:
            continue  # deleted by the series
        added = _added_lines(by_file[rel], texts[rel])
        tree = ast.parse(texts[rel], filename=rel)
        _Scanner(rel, added, _aliases(tree), out).visit(tree)
    return out


# =========================================================================== the registry


@dataclass
class Entry:
    """One function of ours that a patch uses, and where (a row of the table)."""

    kind: str  # "hook", "passthrough", "undeclared", "missing"
    name: str  # the hook's or passthrough's name; the function's path otherwise
    sites: list[tuple[Site, str | None]] = field(default_factory=list)  # (site, via)


@dataclass
class Model:
    """Everything the document says, and every problem the check reports."""

    hooks: list[Any]  # HookSpec, by name
    passthrough: list[Any]  # Passthrough, by name
    entries: dict[tuple[str, str], Entry]
    methods: list[tuple[str, list[MethodDef], list[str], list[str], list[str]]]
    internal_callers: dict[str, list[str]]
    poison_env: str
    poison_default: int
    counter_prefix: str
    problems: list[str]


def import_registry() -> tuple[ModuleType, ModuleType]:
    """Import every hook module (registers every hook and passthrough); returns
    (policy, metrics)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        startup = importlib.import_module(f"{PACKAGE}.startup")
        for name in startup.HOOK_MODULES:
            importlib.import_module(name)
    return (importlib.import_module(f"{PACKAGE}.policy"),
            importlib.import_module(f"{PACKAGE}.metrics"))


def module_drift() -> list[str]:
    """Imported ``sglang.pdsafe`` modules that are not byte-identical to this repository's
    (the table would describe other code than the repository's)."""
    problems = []
    for name, mod in sorted(sys.modules.items()):
        if not (name == PACKAGE or name.startswith(PACKAGE + ".")) or mod is None:
            continue
        installed = getattr(mod, "__file__", None)
        if not installed:
            continue
        rel = Path(installed).name if name != PACKAGE else "__init__.py"
        ours = MODULES_DIR / rel
        if not ours.is_file() or ours.read_bytes() != Path(installed).read_bytes():
            problems.append(f"the imported {name} ({installed}) is not "
                            f"python/sglang/pdsafe/{rel}: reinstall the fork or copy the "
                            "modules over it (CONTRIBUTING.md) before generating the table")
    return problems


def _lookup(target: str) -> Any:
    """The object a dotted path names (longest importable module prefix, then attributes);
    None when it does not exist."""
    parts = target.split(".")
    for cut in range(len(parts), 1, -1):
        name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                continue
            raise
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def _path(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _delegate(obj: Any) -> Any:
    """The hook ``obj`` hands its whole call to (its body, after a docstring, is one
    ``return <name>(...)`` where the name is a hook of its module), else None."""
    if not inspect.isfunction(obj):
        return None
    try:
        node = ast.parse(inspect.cleandoc("\n" + inspect.getsource(obj))).body[0]
    except (OSError, TypeError, SyntaxError):
        return None
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if (len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call)
            and isinstance(body[0].value.func, ast.Name)):
        fn = obj.__globals__.get(body[0].value.func.id)
        return getattr(fn, "__pdsafe_hook__", None)
    return None


def _short(path: str) -> str:
    return path[len(PACKAGE) + 1:] if path.startswith(PACKAGE + ".") else path


def resolve(site: Site, passthrough_by_fn: dict[str, Any]) -> tuple[str, str, str | None]:
    """(kind, name, via) of a site (kind "ignored" for reads of constants, classes and
    modules)."""
    try:
        obj = _lookup(site.target)
    except ImportError as e:
        return "missing", f"{site.target} ({type(e).__name__}: {e})", None
    if obj is None:
        return "missing", site.target, None
    if isinstance(obj, ModuleType):
        return "ignored", site.target, None
    spec = getattr(obj, "__pdsafe_hook__", None)
    if spec is not None:
        return "hook", spec.name, None
    path = _path(obj)
    if path in passthrough_by_fn:
        return "passthrough", passthrough_by_fn[path].name, None
    spec = _delegate(obj)
    if spec is not None:
        return "hook", spec.name, _short(path)
    if not site.call and not inspect.isfunction(obj):
        return "ignored", site.target, None
    return "undeclared", path, None


def _pdsafe_module_files() -> list[Path]:
    return sorted(p for p in MODULES_DIR.glob("*.py") if p.name != "__init__.py")


def method_users(names: Iterable[str]) -> dict[str, list[str]]:
    """Method name -> our modules that use it (``x.<name>``, ``getattr(x, "<name>")``)."""
    wanted = set(names)
    out: dict[str, set[str]] = {n: set() for n in wanted}
    for path in _pdsafe_module_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in wanted:
                out[node.attr].add(path.stem)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value in wanted):
                out[node.args[1].value].add(path.stem)
    return {n: sorted(v) for n, v in out.items()}


def hook_callers(hooks: Iterable[Any]) -> dict[str, list[str]]:
    """Hook name -> ``module: function`` of our own code that calls it (modules imported by
    the hook modules; names resolved through each module's globals and imports)."""
    hooks = list(hooks)
    by_id = {id(s): s.name for s in hooks}
    out: dict[str, set[str]] = {s.name: set() for s in hooks}
    for path in _pdsafe_module_files():
        mod = sys.modules.get(f"{PACKAGE}.{path.stem}")
        if mod is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        names = dict(vars(mod))
        for alias, target in _aliases(tree).items():
            try:
                names.setdefault(alias, _lookup(target))
            except ImportError:
                continue  # an optional module (e.g. triton's): not a caller of ours
        for scope, node in _walk_scoped(tree):
            if not isinstance(node, (ast.Name, ast.Attribute)):
                continue
            dotted = _dotted(node)
            spec = getattr(_resolve_in(names, dotted), "__pdsafe_hook__", None) if dotted else None
            if spec is not None and id(spec) in by_id:
                out[spec.name].add(f"{path.stem}: {scope}")
    return {n: sorted(v) for n, v in out.items()}


def _resolve_in(names: dict[str, Any], dotted: str) -> Any:
    """The object ``dotted`` names, its head looked up in ``names`` (None: not found)."""
    head, *rest = dotted.split(".")
    obj = names.get(head)
    for attr in rest:
        obj = getattr(obj, attr, None)
    return obj


def _walk_scoped(tree: ast.AST) -> Iterable[tuple[str, ast.AST]]:
    """(enclosing function's dotted name, node) for every node (top-down)."""
    todo: list[tuple[str, ast.AST]] = [("<module>", tree)]
    while todo:
        scope, node = todo.pop()
        yield scope, node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = node.name if scope == "<module>" else f"{scope}.{node.name}"
        todo.extend((scope, c) for c in reversed(list(ast.iter_child_nodes(node))))


def build(found: Scan, policy: ModuleType, metrics: ModuleType) -> Model:
    """The table's content and the check's problems, from a :func:`scan` of the series and
    the imported registry (:func:`import_registry`)."""
    hooks = [policy.HOOKS[n] for n in sorted(policy.HOOKS)]
    passthrough = [policy.PASSTHROUGH[n] for n in sorted(policy.PASSTHROUGH)]
    by_fn = {p.function: p for p in passthrough}
    problems = module_drift() + list(found.unknown)
    entries: dict[tuple[str, str], Entry] = {}
    for site in sorted(found.sites, key=lambda s: (s.patch, s.file, s.line, s.target)):
        kind, name, via = resolve(site, by_fn)
        if kind == "ignored":
            continue
        entries.setdefault((kind, name), Entry(kind, name)).sites.append((site, via))
        if kind == "undeclared":
            problems.append(f"{site.where}: calls {_short(name)}, which is neither a hook "
                            "(@policy.hook) nor a passthrough (@policy.passthrough)")
        elif kind == "missing":
            problems.append(f"{site.where}: uses {site.target}, which does not exist")
    for spec in hooks:
        called = ("hook", spec.name) in entries
        internal = bool(getattr(spec, "internal", False))
        if spec.counter not in metrics.COUNTERS:
            problems.append(f"hook {spec.name}: its counter {spec.counter!r} is not declared "
                            "in metrics.COUNTERS")
        if not called and not internal:
            problems.append(f"hook {_hook_label(spec)} has no call site in any patch and is not "
                            "marked pdsafe-internal (HookSpec.internal)")
        if called and internal:
            problems.append(f"hook {spec.name} is marked pdsafe-internal, but patches call it")
    for p in passthrough:
        if ("passthrough", p.name) not in entries:
            problems.append(f"passthrough {p.name} is called by no patch: drop the "
                            "declaration or the function")
    callers = hook_callers(s for s in hooks if ("hook", s.name) not in entries)
    return Model(hooks, passthrough, entries, _methods(found, entries), callers,
                 policy.ENV_POISON_AFTER, policy.DEFAULT_POISON_AFTER, metrics.PREFIX,
                 problems)


def _hook_label(spec: Any) -> str:
    """``name`` or ``name (module.function)`` where the function's name differs."""
    fn = _short(spec.function)
    return spec.name if fn == spec.name else f"{spec.name} ({fn})"


def _methods(found: Scan, entries: dict[tuple[str, str], Entry]
             ) -> list[tuple[str, list[MethodDef], list[str], list[str], list[str]]]:
    """Per ``pdsafe_*`` method name that calls our code: its definitions, what of ours it
    calls (hook, passthrough or undeclared function), its upstream callers and our modules
    that use it."""
    calls: dict[str, set[str]] = {}
    for e in entries.values():
        for s, _ in e.sites:
            for m in found.methods:
                if s.file == m.file and (s.scope == f"{m.cls}.{m.name}"
                                         or s.scope.startswith(f"{m.cls}.{m.name}.")):
                    calls.setdefault(m.name, set()).add(_short(e.name))
    users = method_users(calls)
    out = []
    for name in sorted(calls):
        defs = sorted({m for m in found.methods if m.name == name},
                      key=lambda m: (m.patch, m.file, m.cls))
        upstream = sorted({f"`{_file(f)}`: `{scope}`" for n, f, scope, _ in found.method_calls
                           if n == name})
        out.append((name, defs, sorted(calls[name]), upstream, users[name]))
    return out


# =========================================================================== the document


def _file(rel: str) -> str:
    return rel[len("python/"):] if rel.startswith("python/") else rel


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _sites_cell(sites: list[tuple[Site, str | None]]) -> tuple[str, str]:
    where = sorted({f"`{_file(s.file)}`: `{s.scope}`" + (f" (through `{via}`)" if via else "")
                    for s, via in sites})
    patches = sorted({s.patch[:4] for s, _ in sites})
    return "<br>".join(where), ", ".join(patches)


def render(model: Model) -> str:
    """The document (deterministic: sorted, no time, no host)."""
    prefix = model.counter_prefix
    out = [
        "# Failure policy of the pdsafe hooks",
        "",
        "<!-- Generated by scripts/pdsafe-patches failure-policy: do not edit by hand. -->",
        "",
        "Generated from the code (`policy.HOOKS` and `policy.PASSTHROUGH` of the modules in",
        "`sglang.pdsafe.startup.HOOK_MODULES`, and the lines `patches/` adds to upstream",
        "files) by",
        "",
        "```bash",
        COMMAND,
        "```",
        "",
        "**Do not edit by hand**: change the hook's declaration (`@policy.hook(...)` in",
        "`python/sglang/pdsafe/`) or the patch, then regenerate. CI",
        "(`test/unit/test_failure_policy_table.py`) runs it with `--check`.",
        "",
        "Every function of ours that a patch calls is a hook with a declared failure outcome,",
        "or a declared passthrough (CONTRIBUTING.md). What a hook's failure does (an exception",
        "in its body; its decisions are not failures):",
        "",
        "- **REFUSE**: the request (or transfer) in hand is refused now with an explicit error;",
        "  the peer leg is told through the same path as any other refusal of that site.",
        "- **HOLD**: the pages in hand are never freed by this path (leaked rather than freed",
        "  twice); they stay accounted to this server until evidence or restart.",
        "- **POISON**: this server stops admitting PD requests (HTTP 503, `/health` says why)",
        "  until it is restarted.",
        "",
        "Each failure is counted once per hook and request (its key) in the hook's counter,",
        "and charged to the poison threshold: after",
        f"`{model.poison_env}` distinct hook failures (default {model.poison_default})",
        "the server poisons itself.",
        "",
        "The hook column names the function too where it differs from the hook's name. A call",
        "site named `Class.pdsafe_*` is a method a patch adds to that upstream class: its",
        "callers are listed under *Methods the patches add*.",
        "",
        f"## Hooks ({len(model.hooks)})",
        "",
        "| hook | outcome | what a failure does | counter | upstream call site(s) | patch |",
        "|---|---|---|---|---|---|",
    ]
    rows = []
    for spec in model.hooks:
        entry = model.entries.get(("hook", spec.name))
        if entry is None:
            where, patches, order = "none: pdsafe-internal (below)", "", "9999"
        else:
            where, patches = _sites_cell(entry.sites)
            order = patches.split(", ")[0]
        fn = _short(spec.function)
        hook = f"`{spec.name}`" + (f" (`{fn}`)" if fn != spec.name else "")
        rows.append((order, spec.name, (
            f"| {hook} | {spec.outcome.name} | {_cell(spec.effect)} | "
            f"`{prefix}{spec.counter}` | {where} | {patches} |")))
    out += [r for _, _, r in sorted(rows)]
    out += ["", f"## Passthrough functions ({len(model.passthrough)})", "",
            "Functions upstream calls that decide nothing about isolation: their exceptions are",
            "upstream's (no failure outcome).", "",
            "| name | function | why | upstream call site(s) | patch |", "|---|---|---|---|---|"]
    for p in model.passthrough:
        entry = model.entries.get(("passthrough", p.name))
        where, patches = _sites_cell(entry.sites) if entry else ("none", "")
        out.append(f"| `{p.name}` | `{_short(p.function)}` | {_cell(p.why)} | {where} | "
                   f"{patches} |")
    undeclared = sorted((e for e in model.entries.values()
                         if e.kind in ("undeclared", "missing")), key=lambda e: e.name)
    if undeclared:
        out += ["", f"## Undeclared calls ({len(undeclared)})", "",
                "Functions of ours that patches call with no declared failure outcome and no",
                "passthrough declaration (`--check` fails until each is one or the other).", "",
                "| function | upstream call site(s) | patch |", "|---|---|---|"]
        for e in undeclared:
            where, patches = _sites_cell(e.sites)
            out.append(f"| `{_short(e.name)}` | {where} | {patches} |")
    internal = [s for s in model.hooks if ("hook", s.name) not in model.entries]
    out += ["", f"## Hooks without an upstream call site ({len(internal)})", ""]
    if internal:
        out += ["Called only by pdsafe's own modules (their callers' hooks guard the upstream",
                "call); a hook here that is not marked pdsafe-internal fails `--check`.", "",
                "| hook | outcome | marked internal | called by (pdsafe) |", "|---|---|---|---|"]
        for s in internal:
            callers = "<br>".join(f"`{c}`" for c in model.internal_callers.get(s.name, []))
            marked = "yes" if getattr(s, "internal", False) else "no"
            out.append(f"| `{s.name}` | {s.outcome.name} | {marked} | {callers or 'nobody'} |")
    else:
        out.append("None: every hook is called by a patch.")
    out += ["", f"## Methods the patches add ({len(model.methods)})", "",
            "`pdsafe_*` methods that patches add to upstream classes and that call our code.", "",
            "| method | defined on | patch | calls | called from upstream | used by (pdsafe) |",
            "|---|---|---|---|---|---|"]
    for name, defs, calls, upstream, users in model.methods:
        classes = "<br>".join(f"`{_file(d.file)}`: `{d.cls}`" for d in defs)
        patches = ", ".join(sorted({d.patch[:4] for d in defs}))
        out.append(f"| `{name}` | {classes} | {patches} | "
                   + "<br>".join(f"`{c}`" for c in calls) + " | "
                   + ("<br>".join(upstream) or "none") + " | "
                   + (", ".join(f"`{u}`" for u in users) or "none") + " |")
    return "\n".join(out) + "\n"


# =========================================================================== the command


def run(out: Path, check: bool, patches_dir: Path) -> int:
    """Write (or with ``check`` compare) the table at ``out``; one line per problem on
    stderr; exit status 1 when there is any."""
    policy, metrics = import_registry()
    model = build(scan(patches_dir), policy, metrics)
    text = render(model)
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    problems = check_problems(model, out) if check else list(model.problems)
    if not check:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {shown}: {len(model.hooks)} hooks, {len(model.passthrough)} passthrough, "
              f"{len(model.methods)} pdsafe_* methods")
    for p in problems:
        print(f"failure-policy: {p}", file=sys.stderr)
    if problems:
        print(f"failure-policy: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    if check:
        print(f"{shown} is up to date: every call from the patches is a hook or a passthrough "
              f"({len(model.hooks)} hooks, {len(model.passthrough)} passthrough)")
    return 0


def check_problems(model: Model, out: Path) -> list[str]:
    """Every problem ``--check`` reports: the document at ``out`` differs from
    :func:`render` (first), then the model's own problems."""
    text = render(model)
    current = out.read_text() if out.is_file() else None
    shown = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    stale = [] if current == text else [_stale(shown, current, text)]
    return stale + list(model.problems)


def _stale(shown: Path, current: str | None, text: str) -> str:
    if current is None:
        return f"{shown} does not exist; generate it: {COMMAND}"
    old, new = current.splitlines(), text.splitlines()
    at = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
              min(len(old), len(new)))
    return (f"{shown} differs from the generated table (first at line {at + 1}: "
            f"{new[at][:120] if at < len(new) else '<end>'!r}); regenerate: {COMMAND}")
