"""Stage digests: a hash of everything that determines a stage's outputs.

digest = sha256(kind, validated config, input digests, plugin versions + source hashes, the
source of the runner and the alignflow modules it imports, the versions of torch, transformers,
DeepSpeed, vLLM and peft (core/fingerprint.py; plan.py adds them), data version, seed). Upstream stages
enter through their own digests, so a change reaches exactly a stage and its descendants.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import sqlite3
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from alignflow.core import pyast
from alignflow.core.contracts import digest_dump
from alignflow.core.fingerprint import distribution_version
from alignflow.core.spec.stage import ResolvedStage, StageSpec, resolve_input  # noqa: F401  (dg.resolve_input)

DIGEST_CHARS = 16  # 64 bits: ample for the artifacts of one project, short enough to read


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: equal configs give equal strings."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class HashCache:
    """Content hashes of files keyed by (path, size, mtime_ns, inode), as git's index and DVC's state db
    keep them: an unchanged multi-GB checkpoint is not re-read on every run. A file modified within the
    last `RACY_SECONDS` is hashed but not remembered (it could change again within the same mtime tick).
    A cache that cannot be opened or written is skipped: hashing is then just slower."""

    RACY_SECONDS = 2.0

    def __init__(self, db: Path | None):
        self.db: Path | None = db
        self._conn = None

    def _connect(self):
        if self._conn is None and self.db is not None:
            try:
                self.db.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.db, timeout=30)
                conn.execute("CREATE TABLE IF NOT EXISTS hashes (path TEXT PRIMARY KEY, size INTEGER, "
                             "mtime_ns INTEGER, inode INTEGER, sha256 TEXT)")
                self._conn = conn
            except (OSError, sqlite3.Error):
                self.db = None  # read-only or broken location: hash without remembering
        return self._conn

    def file(self, path: Path) -> str:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
        conn = self._connect()
        if conn is not None:
            try:
                row = conn.execute("SELECT sha256 FROM hashes WHERE path=? AND size=? AND mtime_ns=? "
                                   "AND inode=?", key).fetchone()
            except sqlite3.Error:
                row = None
            if row:
                return row[0]
        digest = hash_file(path)
        if conn is not None and time.time() - st.st_mtime_ns / 1e9 > self.RACY_SECONDS:
            with contextlib.suppress(sqlite3.Error), conn:
                conn.execute("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?)", (*key, digest))
        return digest

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


NO_CACHE = HashCache(None)


def hash_path(path: Path, cache: HashCache = NO_CACHE) -> str:
    """Content hash of a file, or of a folder's relative paths and file contents."""
    if path.is_file():
        return cache.file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(path).as_posix()}\0{cache.file(p)}\n".encode())
    return h.hexdigest()



def _parse_text(text: str) -> ast.Module:
    return pyast.parse(text)  # safe across threads (stages planned or digested at once)


def _parse(path: str | None) -> ast.Module | None:
    """The module at `path` parsed, or None when there is none or it cannot be read or parsed."""
    try:
        return _parse_text(Path(path).read_text()) if path else None
    except (OSError, SyntaxError, ValueError):
        return None

def _module_file(name: str) -> str | None:
    """The source file of module `name`, found without importing it (its parent packages do get imported)."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def _source_imports(name: str) -> set[str]:
    """Modules the source of `name` imports anywhere, inside functions too (a lazy `from alignflow.core
    import models` in a plugin's method is as much a dependency as one at the top): every `import X`, and
    for `from X import Y` both X and X.Y (kept by the caller only where X.Y is a module)."""
    path = _module_file(name)
    tree = _parse(path)
    package = name if path and Path(path).name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            try:
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                    if node.level else node.module
            except (ImportError, ValueError):
                continue
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _closure(module_name: str, inside) -> set[str]:
    """Modules `inside(name)` reachable from `module_name` through module attributes (imported modules,
    classes and functions) and through the imports its source makes anywhere, transitively."""
    seen, todo = set(), [module_name]
    while todo:
        name = todo.pop()
        if name in seen or _module_file(name) is None:
            continue
        seen.add(name)
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            dep = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
            if not isinstance(dep, str) or dep in seen or not inside(dep):
                continue
            if inspect.ismodule(value) and dep.startswith(name + "."):
                continue  # a package's submodules are its attributes once imported, not its dependencies
            todo.append(dep)
        todo += [dep for dep in _source_imports(name) if dep not in seen and inside(dep)]
    return seen


def _hash_modules(names: set[str]) -> str:
    h = hashlib.sha256()
    for name in sorted(names):
        path = _module_file(name)
        h.update(f"{name}:{source_hash(Path(path)) if path else ''}\n".encode())
    return h.hexdigest()


def source_hash(path: Path) -> str:
    """sha256 of what a module's code does: its syntax tree without docstrings, comments or layout, so a
    docstring fix or a reformat reruns nothing; a file that is not Python source is hashed as bytes."""
    stat = path.stat()
    return _source_hash(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4096)
def _source_hash(path: str, size: int, mtime_ns: int) -> str:
    try:
        tree = _parse_text(Path(path).read_text()) if path.endswith(".py") else None
    except (SyntaxError, UnicodeDecodeError, ValueError):
        tree = None
    if tree is None:
        return hash_file(Path(path))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return sha256_text(ast.dump(tree, include_attributes=False))


def code_hash(module_name: str, package: str = "alignflow.") -> str:
    """sha256 over the source of a module and of every `package` module it imports, transitively.

    A stage runner's output depends on the helpers it calls (the shared training loop, tokenisation,
    scoring), not only on its own file: an edit to any of them reruns the stage, imports made inside
    functions included.
    """
    return _hash_modules(_closure(module_name, lambda dep: dep.startswith(package)))


def _imported_tops(module_name: str) -> set[str]:
    """Top-level names of the absolute imports in a module's source, wherever they are made."""
    tree = _parse(getattr(sys.modules.get(module_name), "__file__", None))
    tops = set()
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Import):
            tops |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.partition(".")[0])
    return tops


@lru_cache(maxsize=1)
def _distributions_of() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def plugin_code(obj: Any, distribution: str | None = None) -> dict:
    """What a plugin's behaviour depends on: `source`, a hash of its module and of every module of its
    own distribution (its top-level package, the distribution's others, and alignflow's) it imports,
    transitively; `imports`, the version of every other distribution those modules import."""
    module = getattr(obj, "__module__", None) or ""
    mapping = _distributions_of()
    own = {module.partition(".")[0], "alignflow"}
    own |= {top for top, dists in mapping.items() if distribution and distribution in dists}
    seen = _closure(module, lambda dep: dep.partition(".")[0] in own)
    outside = {top for name in seen for top in _imported_tops(name)} - own  # static: the same in any process
    imports = {}
    for top in sorted(outside - set(sys.stdlib_module_names) - {"builtins"}):
        for dist in mapping.get(top, []):
            try:
                imports[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
    return {"source": _hash_modules(seen) if seen else None, "imports": imports}


def data_version(project: Path) -> str | None:
    """The md5 DVC recorded for the tracked data in `data.dvc`; None without DVC."""
    dvc_file = project / "data.dvc"
    if not dvc_file.is_file():
        return None
    outs = (yaml.safe_load(dvc_file.read_text()) or {}).get("outs") or []
    return outs[0].get("md5") if outs else None


def stage_config(stage: StageSpec, resolved: ResolvedStage) -> dict:
    """The stage's config: its resolved plugin configs and settings (core/spec/stage.py), defaults filled, as JSON,
    without operational fields (`alignflow.core.contracts.operational`: a scorer's URL, timeouts)."""
    def ref(r, use):
        out = {"name": r.name, "config": digest_dump(use.config) if use.config is not None else {}}
        return {**out, "weight": r.weight} if hasattr(r, "weight") else out

    config = {
        "kind": stage.kind,
        "algorithm": ref(stage.algorithm, resolved.algorithm) if stage.algorithm else None,
        "sampler": ref(stage.sampler, resolved.sampler) if stage.sampler else None,
        "rewards": [ref(r, use) for r, use in zip(stage.rewards, resolved.rewards, strict=True)],
        "selectors": [ref(s, use) for s, use in zip(stage.selectors, resolved.selectors, strict=True)],
        "settings": digest_dump(resolved.settings),
    }
    if stage.environment is not None:  # only then: the digests of stages without one stay as they were
        env = stage.environment
        config["environment"] = {**ref(env, resolved.environment), "max_turns": env.max_turns,
                                 "max_tokens": env.max_tokens, "tool_format": env.tool_format}
        if env.mcp:  # only then, likewise: a different server, command or tool list is a different tool set
            config["environment"]["mcp"] = [server.model_dump(mode="json", exclude={"start_timeout_s"})
                                            for server in env.mcp]
    return config


def plugin_versions(stage: StageSpec, plugins) -> dict[str, dict]:
    """{kind/name: {distribution, version, source}} for every plugin the stage uses."""
    refs = [("algorithm", stage.algorithm, plugins.algorithms), ("sampler", stage.sampler, plugins.samplers)]
    refs += [("reward", r, plugins.rewards) for r in stage.rewards]
    refs += [("selector", s, plugins.selectors) for s in stage.selectors]
    refs += [("environment", stage.environment, plugins.environments)]
    versions = {}
    for kind, ref, registry in refs:
        if ref is None:
            continue
        entry = registry.entry(ref.name)
        versions[f"{kind}/{ref.name}"] = {"distribution": entry.distribution, "version": entry.version,
                                          **plugin_code(entry.obj, entry.distribution), **libraries(entry.obj)}
    return versions


def libraries(obj) -> dict:
    """The versions of the other distributions a plugin declares it runs (`libraries`, e.g. a task library
    an adapter wraps): an upgrade of one reruns the stage. Nothing for a plugin that declares none."""
    names = getattr(obj, "libraries", ())
    return {"libraries": {name: distribution_version(name) for name in names}} if names else {}


def input_digest(value: Path | str, cache: HashCache = NO_CACHE) -> str:
    return f"file:{hash_path(value, cache)}" if isinstance(value, Path) else f"hub:{value}"


def project_hash_cache(project: Path) -> HashCache:
    """The project's file-hash cache, `.alignflow/hashes.sqlite` (git-ignored)."""
    return HashCache(project / ".alignflow" / "hashes.sqlite")


def stage_digest(parts: dict) -> str:
    """The short digest of a stage's identity parts (see `StagePlan.parts`)."""
    return sha256_text(canonical_json(parts))[:DIGEST_CHARS]
