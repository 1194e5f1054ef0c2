"""The schema's keys: every settable dotted key with its type, and reading/writing a config by dotted key.

The bottom of mppo.config: the loader, resolution and validation all build on it (and none of them on each other
but in that order: keys <- resolve <- validate <- loader).
"""
from __future__ import annotations

import dataclasses
import typing
from functools import lru_cache
from typing import Any

from mppo.config.schema import MppoConfig


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One settable key of the schema."""

    type: Any  # the annotated type, e.g. int, Optional[List[str]]
    choices: tuple[str, ...] | None  # allowed values for str keys (each item for list keys)


@lru_cache(maxsize=None)
def schema_leaves() -> dict[str, Leaf]:
    """Dotted key -> Leaf for every settable key, in schema order."""
    leaves: dict[str, Leaf] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], key + ".")
            else:
                leaves[key] = Leaf(hints[f.name], f.metadata.get("choices"))

    walk(MppoConfig, "")
    return leaves


@lru_cache(maxsize=None)
def schema_sections() -> frozenset[str]:
    return frozenset(k.rsplit(".", i)[0] for k in schema_leaves() for i in range(1, k.count(".") + 1))


def show(value: Any) -> str:
    """A value as the user wrote it in YAML: true, null, 'text', 1e-06."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


def get_key(cfg: Any, key: str) -> Any:
    """The value at dotted `key` of a config dataclass (or of a nested dict)."""
    obj: Any = cfg
    for part in key.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


def set_key(cfg: MppoConfig, key: str, value: Any) -> None:
    parent, _, name = key.rpartition(".")
    setattr(get_key(cfg, parent), name, value)
