"""Every key of configs/ppo_trainer.yaml is read by some code in mppo/ (a setting that nothing reads does nothing,
and a user cannot tell: issue 24 found `trust_remote_code` and `filter_groups.metric` so).

How "read" is decided: a static scan of mppo/'s syntax trees, not a run. A run reads only the keys of the features
it turns on, and no test run turns on every feature in seconds; a scan sees every code path. The scan follows
config values the way the code passes them around, as schema paths:

- a name annotated with a schema dataclass (`cfg: MppoConfig`, `fg: FilterGroupsConfig`, `Optional[...]`) holds
  that section (for a class used at several paths, such as OptimConfig for the actor and the critic, every one of
  them: the function serves them all);
- `x.field` of a known section is the child path; a local or `self.` attribute assigned from a known value holds it
  (flow-insensitive: every assignment in the function or class counts), as do `getattr(x, "field")` (also over a
  loop of constant names) and `get_key(cfg, "dotted.key")` (f-strings with module string constants resolved);
- an attribute chain over an unknown value still counts when its last two or more names end schema paths
  (`anything.kl_ctrl.kl_coef`), because much of the code receives sections untyped.

The reading in mppo/config's machinery does not count: the schema, loader and resolution touch every key
generically (defaults, overrides), and validation only accepts or refuses values, so a key that only they read
changes nothing in a run. Neither does a generic walk of the whole config (`dataclasses.asdict`, as the resume
check does). The scan over-approximates where the code is generic: a field read through a function typed with a
class used at several paths (OptimConfig, MegatronConfig), or through an untyped chain whose tail ends several
paths (`x.optim.lr`), counts as read at each of them. It fails on a key nothing reads at all, the defect it is for.

ALLOWLIST names each key that nothing reads and why that is acceptable (test_allowlist_is_needed keeps it current).
"""
from __future__ import annotations

import ast
import dataclasses
import typing
from functools import lru_cache
from pathlib import Path

import yaml

from mppo.config.keys import schema_leaves, schema_sections
from mppo.config.schema import MppoConfig

ROOT = Path(__file__).resolve().parents[1]
# mppo/config's generic machinery (see the module docstring): decisions.py is not in it, it decides the run.
GENERIC = {"mppo/config/schema.py", "mppo/config/keys.py", "mppo/config/loader.py", "mppo/config/resolve.py",
           "mppo/config/validate.py"}
# key -> why it is read although the scan cannot see it (keep this short; every entry needs a reason).
ALLOWLIST: dict[str, str] = {
    "actor_rollout_ref.rollout.multi_turn.format": "one choice (hermes): the loader refuses any other value, and "
                                                   "hermes is the one format the agent loop parses; kept for "
                                                   "veRL's command lines",
    **{f"actor_rollout_ref.ref.megatron.{key}": "MegatronConfig's, shared with the actor and critic; the frozen "
                                                "reference has no optimizer and no RNG of its own, so validation "
                                                "warns when it is set (mppo.config.validate.REF_INERT_KEYS)"
       for key in ("seed", "optimizer_offload")},
    **{f"{role}.megatron.{key}": "one layout for every model: megatron's process groups are built from the actor's, "
                                 "and validation refuses any other value (mppo.config.validate.check_shared_layout)"
       for role in ("actor_rollout_ref.ref", "critic")
       for key in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                   "expert_model_parallel_size")},
}


# ------------------------------------------------------------------------------------------------------- schema
def _class_paths() -> dict[str, set[str]]:
    """Schema dataclass name -> the section paths it is the type of ("" for MppoConfig itself)."""
    out: dict[str, set[str]] = {}

    def walk(cls: type, prefix: str) -> None:
        out.setdefault(cls.__name__, set()).add(prefix)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}" if not prefix else f"{prefix}.{f.name}")

    walk(MppoConfig, "")
    return out


CLASS_PATHS = _class_paths()
LEAVES = set(schema_leaves())
NODES = LEAVES | set(schema_sections()) | {""}


def _child(path: str, name: str) -> str | None:
    child = f"{path}.{name}" if path else name
    return child if child in NODES else None


def _path_tails() -> dict[str, set[str]]:
    """"b.c" -> the schema paths ending in ".b.c" (or equal to it), for every tail of two or more names."""
    tails: dict[str, set[str]] = {}
    for path in NODES:
        parts = path.split(".")
        for start in range(len(parts) - 1):
            tails.setdefault(".".join(parts[start:]), set()).add(path)
    return tails


PATH_TAILS = _path_tails()


def _suffix_paths(names: list[str]) -> set[str]:
    """Schema paths ending in the longest run (>= 2) of `names`' tail that ends some path; empty when none."""
    for start in range(len(names) - 1):
        found = PATH_TAILS.get(".".join(names[start:]))
        if found:
            return found
    return set()


# ----------------------------------------------------------------------------------------------------- the scan
def _annotation_paths(node: ast.expr | None) -> set[str]:
    """Section paths of an annotation naming schema dataclasses (in Optional/Union/strings too)."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    found: set[str] = set()
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
        found |= CLASS_PATHS.get(name, set())
    return found


class _Scan:
    def __init__(self, string_constants: dict[str, set[str]]) -> None:
        self.read: dict[str, set[str]] = {}  # leaf -> where
        self.strings = string_constants
        self.where = ""

    def mark(self, path: str) -> None:
        if path in LEAVES:
            self.read.setdefault(path, set()).add(self.where)

    # a value: the set of schema paths an expression may hold
    def value(self, node: ast.expr, env: dict[str, set[str]], attrs: dict[str, set[str]]) -> set[str]:
        if isinstance(node, ast.Name):
            return env.get(node.id, set())
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in attrs:
                return attrs[node.attr]
            return self.field(node.value, {node.attr}, env, attrs)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.value(v, env, attrs) for v in node.values))
        if isinstance(node, ast.IfExp):
            return self.value(node.body, env, attrs) | self.value(node.orelse, env, attrs)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            if node.func.id == "getattr":
                return self.field(node.args[0], self.names(node.args[1], env), env, attrs)
            if node.func.id == "get_key":
                for key in self.names(node.args[1], env):
                    for p in {key} | {c for b in self.value(node.args[0], env, attrs) if (c := _child(b, key))}:
                        self.mark(p)
                return set()
        return set()

    def field(self, base_node: ast.expr, names: set[str], env: dict[str, set[str]], attrs: dict[str, set[str]]
              ) -> set[str]:
        """`base.name` for each of `names`: the child paths of a known base, else those the chain's tail names."""
        base = self.value(base_node, env, attrs)
        out = {c for p in base for n in names if (c := _child(p, n))}
        if not base:
            chain, inner = [], base_node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name):
                chain.append(inner.id)
            out = set().union(*(_suffix_paths([*chain[::-1], n]) for n in names))
        for p in out:
            self.mark(p)
        return out

    def names(self, node: ast.expr, env: dict[str, set[str]]) -> set[str]:
        """The strings an expression may be: a constant, a loop variable over constants, an f-string."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name):
            return env.get("str:" + node.id, set()) | self.strings.get(node.id, set())
        if isinstance(node, ast.JoinedStr):
            parts = [{v.value} if isinstance(v, ast.Constant) else self.names(v.value, env) for v in node.values]
            out = {""}
            for options in parts:
                out = {a + b for a in out for b in options}
            return out
        return set()

    def bind(self, target: ast.expr, value: ast.expr | None, env: dict[str, set[str]], attrs: dict[str, set[str]],
             paths: set[str] | None = None) -> bool:
        """Record that `target` may hold `value`'s paths; True when something new was learnt."""
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            return any([self.bind(t, v, env, attrs) for t, v in zip(target.elts, value.elts)])
        paths = self.value(value, env, attrs) if paths is None and value is not None else (paths or set())
        if isinstance(target, ast.Name):
            store, key = env, target.id
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            store, key = attrs, target.attr
        else:
            return False
        if paths - store.get(key, set()):
            store[key] = store.get(key, set()) | paths
            return True
        return False

    def function(self, fn: ast.AST, outer: dict[str, set[str]], attrs: dict[str, set[str]]) -> bool:
        """Scan one function body (to a fixpoint of its local bindings); True when `attrs` grew."""
        env = dict(outer)
        grew = False
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = fn.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                        *([a.kwarg] if a.kwarg else [])]:
                env.pop(arg.arg, None)
                if arg.annotation is not None and _annotation_paths(arg.annotation):
                    env[arg.arg] = _annotation_paths(arg.annotation)
        body = fn.body if isinstance(fn.body, list) else [fn.body]
        nested: list[ast.AST] = []
        nodes = [node for stmt in body for node in _own_nodes(stmt, nested)]
        for _ in range(4):
            changed = False
            for node in nodes:
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        before = {k: set(v) for k, v in attrs.items()}
                        changed |= self.bind(t, node.value, env, attrs)
                        grew |= before != attrs
                elif isinstance(node, ast.AnnAssign):
                    before = {k: set(v) for k, v in attrs.items()}
                    paths = _annotation_paths(node.annotation) | (
                        self.value(node.value, env, attrs) if node.value is not None else set())
                    changed |= self.bind(node.target, None, env, attrs, paths)
                    grew |= before != attrs
                elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                        and isinstance(node.iter, (ast.Tuple, ast.List)):
                    consts = {e.value for e in node.iter.elts if isinstance(e, ast.Constant)
                              and isinstance(e.value, str)}
                    key = "str:" + node.target.id
                    if consts - env.get(key, set()):
                        env[key] = env.get(key, set()) | consts
                        changed = True
                elif isinstance(node, ast.NamedExpr):
                    changed |= self.bind(node.target, node.value, env, attrs)
            if not changed:
                break
        for node in nodes:  # the reads, with the final bindings
            if isinstance(node, ast.expr):
                self.value(node, env, attrs)
        for inner in nested:
            grew |= self.function(inner, env, attrs)
        return grew

    def module(self, tree: ast.Module) -> None:
        """Module-level code, its functions and its classes' methods (nested functions go with their parent)."""
        module_env: dict[str, set[str]] = {}
        top = [s for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        self.function(ast.Module(body=top, type_ignores=[]), {}, {})
        for node in top:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    self.bind(t, node.value, module_env, {})
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                attrs: dict[str, set[str]] = {}
                methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
                for m in node.body:  # dataclass-style fields: `cfg: MppoConfig`
                    if isinstance(m, ast.AnnAssign) and isinstance(m.target, ast.Name):
                        attrs[m.target.id] = _annotation_paths(m.annotation)
                for _ in range(3):
                    if not any([self.function(m, module_env, attrs) for m in methods]):
                        break
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.function(node, module_env, {})


def _own_nodes(stmt: ast.AST, nested: list[ast.AST]) -> list[ast.AST]:
    """The nodes of `stmt` outside nested functions and classes (those go to `nested`)."""
    out, todo = [], [stmt]
    while todo:
        node = todo.pop()
        if node is not stmt and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            if not isinstance(node, ast.ClassDef) and node not in nested:
                nested.append(node)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _string_constants(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module-level NAME = "text" of every module (f-string keys use them: f"{ACTOR}.megatron.seed")."""
    out: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out.setdefault(t.id, set()).add(node.value.value)
    return out


@lru_cache(maxsize=None)
def keys_read() -> dict[str, set[str]]:
    """Leaf key -> the mppo/ files that read it."""
    trees = {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in sorted((ROOT / "mppo").rglob("*.py"))}
    scan = _Scan(_string_constants(trees))
    for name, tree in trees.items():
        if name not in GENERIC:
            scan.where = name
            scan.module(tree)
    return scan.read


def _yaml_leaves(node: object, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in _yaml_leaves(value, f"{prefix}{key}.")]
    return [prefix[:-1]]


# ------------------------------------------------------------------------------------------------------- tests
def test_every_key_of_the_defaults_file_is_read() -> None:
    yaml_keys = _yaml_leaves(yaml.safe_load((ROOT / "configs" / "ppo_trainer.yaml").read_text()))
    assert set(yaml_keys) == LEAVES  # the file lists the schema's keys (test_config keeps them equal too)
    read = keys_read()
    unread = [k for k in yaml_keys if k not in read and k not in ALLOWLIST]
    assert not unread, f"keys of configs/ppo_trainer.yaml that no code in mppo/ reads: {unread}"


def test_allowlist_is_needed() -> None:
    """An allowlisted key that the scan sees read (or that no longer exists) is a stale entry."""
    read = keys_read()
    assert not [k for k in ALLOWLIST if k in read or k not in LEAVES]


def test_the_scan_sees_reads_and_misses() -> None:
    """The scan itself: what it counts as a read of a key, and what it does not."""
    source = '''
from mppo.config import MppoConfig
from mppo.config.schema import FilterGroupsConfig, ACTOR
def typed(cfg: MppoConfig):
    fg = cfg.algorithm.filter_groups
    return fg.enable, get_key(cfg, f"{ACTOR}.optim.lr")
def annotated(x: "FilterGroupsConfig | None"):
    return x.max_num_gen_batches
def untyped(c):
    return c.kl_ctrl.kl_coef, [getattr(c.trainer, k) for k in ("seed", "nnodes")]
class T:
    def __init__(self, cfg: MppoConfig):
        self.r = cfg.actor_rollout_ref.rollout
    def use(self):
        return self.r.top_k
def mentions(cfg: MppoConfig):
    return "algorithm.gamma is mentioned, not read", cfg.data
'''
    tree = ast.parse(source)
    scan = _Scan({"ACTOR": {"actor_rollout_ref.actor"}})
    scan.module(tree)
    assert set(scan.read) == {"algorithm.filter_groups.enable", "actor_rollout_ref.actor.optim.lr",
                              "algorithm.filter_groups.max_num_gen_batches", "algorithm.kl_ctrl.kl_coef",
                              "trainer.seed", "trainer.nnodes", "actor_rollout_ref.rollout.top_k"}
