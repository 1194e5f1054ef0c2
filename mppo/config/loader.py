"""Load a run config: dataclass defaults <- YAML file <- `key=value` overrides, then resolve and validate.

Every key is checked against the schema as it is applied, so an unknown key or a wrong type is reported with the
place it came from (file or override) and, for unknown keys, the closest valid keys.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import os
import re
import typing
from functools import lru_cache
from typing import Any, Iterable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mppo.config.keys import get_key, schema_leaves, schema_sections, show
from mppo.config.resolve import resolve
from mppo.config.schema import ConfigError, MppoConfig
from mppo.config.validate import validate


# ------------------------------------------------------------------------------------------ schema introspection
@lru_cache(maxsize=None)
def _structured_defaults() -> DictConfig:
    """The defaults as a typed omegaconf node; build once (~20 ms), deep-copy per load (~2 ms)."""
    return OmegaConf.structured(MppoConfig)


def _fresh_defaults() -> DictConfig:
    return copy.deepcopy(_structured_defaults())


def _base_type(tp: Any) -> Any:
    """Optional[X] -> X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def _union_members(tp: Any) -> list[Any]:
    """The non-None members of a Union (Optional[Union[str, float]] -> [str, float]); [] for other types."""
    return [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else []


def describe_type(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    members = _union_members(tp)
    if len(members) > 1:
        text = " or ".join(names[m] for m in members)
        return text + (" or null" if len(members) < len(typing.get_args(tp)) else "")
    base = _base_type(tp)
    if typing.get_origin(base) in (list, typing.List):
        item = typing.get_args(base)[0]
        text = f"a list of {names[item].split(' ', 1)[1]}s" if item in (int, float, str) else "a list"
    else:
        text = names.get(base, str(base))
    return text + (" or null" if base is not tp else "")


def _closest(word: str, candidates: list[str], cutoff: float, n: int = 3) -> list[str]:
    """Candidates spelt like `word` (difflib ratio >= cutoff), keeping only those nearly as close as the best."""
    scored = sorted(((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in candidates), reverse=True)
    best = scored[0][0] if scored else 0.0
    return [c for r, c in scored if r >= cutoff and r >= best - 0.05][:n]


def suggest_keys(key: str, n: int = 3) -> list[str]:
    """Valid keys closest to an unknown `key`, best first, or [] when nothing is close."""
    leaves = list(schema_leaves())
    parent, _, name = key.rpartition(".")
    if parent and parent not in schema_sections():  # the path is wrong: compare whole keys
        return _closest(key, leaves, 0.6, n) or [k for k in leaves if k.rpartition(".")[2] == name][:n]
    siblings = {k.rpartition(".")[2]: k for k in [*leaves, *schema_sections()] if k.rpartition(".")[0] == parent}
    near = _closest(name, list(siblings), 0.7, n) or [s for s in siblings if len(name) >= 3 and s.startswith(name)]
    if near:  # a misspelt name within the right section
        return [siblings[s] for s in near[:n]]
    same_name = [k for k in leaves if k.rpartition(".")[2] == name]  # the right name in another section
    if same_name:
        return same_name[:n]
    names = {k.rpartition(".")[2]: k for k in leaves}
    return [names[s] for s in _closest(name, list(names), 0.75, n)]


def unknown_key_error(key: str, source: str) -> ConfigError:
    near = suggest_keys(key)
    if near:
        hint = "did you mean " + " or ".join(repr(k) for k in near) + "?"
    else:
        hint = "configs/ppo_trainer.yaml lists every key"
    return ConfigError(f"unknown key '{key}' ({source}); {hint}")


# ------------------------------------------------------------------------------------------------------ YAML input
class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice, reads `1e-6` as a float (YAML 1.1 wants `1.0e-6`) and reads
    numbers written with `_` as strings: `0.5_2.0` is a pair of bounds (rollout correction), and YAML 1.1's
    digit separators would silently turn `5_0.5` into 50.5."""

    def resolve(self, kind, value, implicit):
        tag = super().resolve(kind, value, implicit)
        if tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float") and isinstance(value, str) and "_" in value:
            return "tag:yaml.org,2002:str"
        return tag

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key '{key}' appears twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_YamlLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


# ------------------------------------------------------------------------------------------------ applying values
def _flatten(node: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """Nested mapping -> (dotted key, leaf value); lists are leaves."""
    if isinstance(node, dict) and (node or not prefix):
        for k, v in node.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _is_whole_interpolation(value: Any) -> bool:
    """`${a.b}` alone may stand for a list; `${oc.env:DIR}/x.parquet` is always a string."""
    return isinstance(value, str) and re.fullmatch(r"\$\{[^{}]*\}", value) is not None


def _set_leaf(cfg: DictConfig, key: str, value: Any, source: str) -> None:
    leaves = schema_leaves()
    if key not in leaves:
        if key in schema_sections() and value in (None, {}):
            return  # an empty section (`critic:` with every key commented out) changes nothing
        if key in schema_sections():
            raise ConfigError(f"'{key}' is a section, not a value ({source}); set its keys instead, "
                              f"e.g. '{next(k for k in leaves if k.startswith(key + '.'))}=...'")
        raise unknown_key_error(key, source)
    leaf = leaves[key]
    base = _base_type(leaf.type)
    is_list = typing.get_origin(base) in (list, typing.List)
    if is_list and isinstance(value, str) and not _is_whole_interpolation(value):
        value = [value]  # veRL accepts `data.train_files=one.parquet` for a list key
    wrong = (base is bool and not isinstance(value, bool) and value is not None and not _is_interpolation(value))
    if float in _union_members(leaf.type) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)  # omegaconf takes an int for a float key, but not for a Union[str, float] one
    if not wrong:
        try:
            OmegaConf.update(cfg, key, value, merge=False)
            return
        except OmegaConfBaseException:
            pass
    raise ConfigError(f"{key} must be {describe_type(leaf.type)}, got {show(value)} ({source})")


def parse_override(text: str) -> tuple[str, Any]:
    """'a.b=value' -> ('a.b', value parsed as a YAML scalar or list). A leading '+' (Hydra) is accepted."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' is not of the form key=value (e.g. trainer.seed=1)")
    try:
        value = _parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({str(e).splitlines()[0]})") from None
    return key, value


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = _parse_yaml(f.read())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}:{line} is not valid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (data:, trainer:, ...)")
    return data


def _resolution_error(cfg: DictConfig, error: Exception) -> ConfigError:
    """Name the key whose ${...} interpolation failed (omegaconf's to_object does not always say which)."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    scratch = _fresh_defaults()
    for key, leaf in schema_leaves().items():
        try:  # resolve the key, then assign the result to a fresh schema: both check the type
            OmegaConf.update(scratch, key, OmegaConf.select(cfg, key, throw_on_resolution_failure=True), merge=False)
        except OmegaConfBaseException as e:
            return ConfigError(f"{key}: cannot resolve {show(get_key(raw, key))} as {describe_type(leaf.type)} "
                               f"({str(e).splitlines()[0]})")
    return ConfigError(f"cannot resolve the config's interpolations: {str(error).splitlines()[0]}")


# ------------------------------------------------------------------------------------------------------ public API
def load_config(path: str | None, overrides: Iterable[str] = (), world_size: int | None = None) -> MppoConfig:
    """Defaults <- YAML file at `path` (if any) <- dotted `key=value` overrides; resolved and validated.

    `world_size`: the number of ranks the run will have (torchrun's WORLD_SIZE); None: nnodes x n_gpus_per_node.
    Raises ConfigError (user mistakes) or FileNotFoundError (no such config file).
    """
    cfg = _fresh_defaults()
    if path is not None:
        for key, value in _flatten(_read_yaml(path)):
            _set_leaf(cfg, key, value, f"in {path}")
    for text in overrides:
        key, value = parse_override(text)
        _set_leaf(cfg, key, value, f"override '{text}'")
    try:
        typed: MppoConfig = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _resolution_error(cfg, e) from None
    typed = resolve(typed)
    validate(typed, world_size)
    return typed


def to_yaml(cfg: MppoConfig) -> str:
    """The config as YAML, sections and keys in schema order."""
    return OmegaConf.to_yaml(OmegaConf.create(dataclasses.asdict(cfg)))


def config_hash(cfg: MppoConfig) -> str:
    """Stable SHA-256 (hex) of the config's values: same values, same hash, in any process or Python version."""
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
