"""Typed dataclass configs: load from YAML, override with `key.sub=value`, document every field.

Each field's docstring is the string literal written under it in the dataclass body; `--help`
prints them. Unknown keys and ill-typed values fail with an error naming the key.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override names an unknown key or has a value of the wrong type."""


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring literal that follows it in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


_NULLS = ("null", "none", "~")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (typed from YAML, or raw text from the command line) to field type `tp`."""
    origin = typing.get_origin(tp)
    if tp is Any or (tp is dict and not isinstance(value, str)):
        return value
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in _NULLS)):
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key {key!r}: {value!r} does not match {tp}")
    if origin is typing.Literal:
        for allowed in typing.get_args(tp):
            if value == allowed or (isinstance(value, str) and value == str(allowed)):
                return allowed
        raise ConfigError(f"config key {key!r}: {value!r} is not one of {typing.get_args(tp)}")
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip() != ""]
        elif not isinstance(value, (list, tuple)):
            value = [value]  # a single value is a one-element sequence
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, key) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        value = yaml.safe_load(value) if isinstance(value, str) else value
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"config key {key!r}: expected a bool, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r}: expected an int, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is not None and number.is_integer():
                return int(number)
        raise ConfigError(f"config key {key!r}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r}: expected a float, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key {key!r}: expected a float, got {value!r}") from None
    if tp is str:
        return value if isinstance(value, str) else str(value)
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def apply_dict(cfg: T, values: dict[str, Any], prefix: str = "") -> T:
    """Return a copy of dataclass `cfg` with nested `values` applied (type-checked)."""
    hints = _hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if k not in names:
            raise ConfigError(f"unknown config key {key!r}; valid keys here: {sorted(names)}")
        current = getattr(cfg, k)
        if dataclasses.is_dataclass(current):
            if not isinstance(v, dict):
                raise ConfigError(f"config key {key!r} is a section; give sub-keys like {key}.<name>=...")
            changes[k] = apply_dict(current, v, prefix=key + ".")
        else:
            changes[k] = _coerce(v, hints[k], key)
            if isinstance(current, dict) and isinstance(changes[k], dict):  # a mapping merges (YAML, then the command line)
                changes[k] = {**current, **changes[k]}
    return dataclasses.replace(cfg, **changes)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": "1"}, "c": "x"}`: values stay text until the field type converts them."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with an earlier override of {p!r}")
        node[parts[-1]] = raw
    return out


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML config file; a missing file or another top level fails naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    return data


def load_config(cls: type[T], argv: list[str] | None = None, *, config_key: str = "config") -> T:
    """Defaults of `cls`, then the YAML file given as `config=path.yaml`, then overrides; last, a class
    with a `resolve()` method (GRPOJobConfig: task presets, dtype=auto) has it called, so every field
    the user left to a preset holds its value."""
    argv = list(argv or [])
    cfg = cls()
    files = [a.split("=", 1)[1] for a in argv if a.startswith(f"{config_key}=")]
    for f in files:
        cfg = apply_dict(cfg, load_yaml(f))
    rest = [a for a in argv if not a.startswith(f"{config_key}=")]
    cfg = apply_dict(cfg, parse_overrides(rest))
    resolve = getattr(cfg, "resolve", None)
    return resolve() if callable(resolve) else cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def describe(cfg: Any, prefix: str = "") -> str:
    """Every key with its default value and docstring (for `--help`)."""
    lines = []
    docs = field_docs(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            lines.append(f"{key}: {docs.get(f.name, '')}")
            lines.append(describe(value, prefix=key + "."))
        else:
            lines.append(f"  {key}={value!r}  {docs.get(f.name, '')}")
    return "\n".join(lines)


def check_literals(cfg: Any, prefix: str = "") -> None:
    """Every `Literal` field of a (nested) config dataclass holds an allowed value: catches values set
    in Python, which never pass through the YAML/command-line parser. Raises ConfigError naming the
    key, the value and the allowed values."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, tp, key = getattr(cfg, f.name), hints.get(f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_literals(value, key + ".")
            continue
        allowed = _literal_values(tp)
        if allowed is not None and value not in allowed:
            raise ConfigError(f"config key {key!r}: {value!r} is not one of {allowed}")


def _literal_values(tp: Any) -> tuple | None:
    """The values a `Literal[...]` (or `Literal[...] | None`) field allows, else None."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [_literal_values(a) for a in typing.get_args(tp) if a is not type(None)]
        if inner and all(v is not None for v in inner):
            return tuple(x for v in inner for x in v) + ((None,) if type(None) in typing.get_args(tp) else ())
    return None
