"""Typed dataclass configs: load from YAML, override with `key.sub=value`, document every field.

Each field's docstring is the string literal written under it in the dataclass body; `--help`
prints them. Unknown keys, ill-typed values and values outside a field's `Limit` fail with an error
naming the key; a key a section lists in `moved_keys` fails naming its new place. A field typed as a
union of dataclasses that each fix a one-value `Literal` `name` is a discriminated union: `name`
picks the class, and a key the chosen class lacks fails naming the classes that take it.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override names an unknown key or has a value of the wrong type."""


@dataclasses.dataclass(frozen=True)
class Limit:
    """Bounds of a number field, written in its type (`Annotated[int, Limit(ge=0)]`) and checked wherever
    a value is set: the YAML and the command line (`apply_dict`) and a Python assignment (`check_fields`)."""

    ge: float | None = None
    gt: float | None = None

    def check(self, key: str, value: Any) -> None:
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if self.ge is not None and not value >= self.ge:
            raise ConfigError(f"{key}={value}: must be >= {self.ge:g}")
        if self.gt is not None and not value > self.gt:
            raise ConfigError(f"{key}={value}: must be > {self.gt:g}")


NonNegInt = Annotated[int, Limit(ge=0)]
NonNegFloat = Annotated[float, Limit(ge=0)]
PosInt = Annotated[int, Limit(gt=0)]
PosFloat = Annotated[float, Limit(gt=0)]
"""The common limits, as field types: `steps: NonNegInt = 0`, `lr: PosFloat | None = None`."""


def field_limits(cls: type) -> dict[str, Limit]:
    """Field name -> the `Limit` in its `Annotated[...]` type (also inside `X | None`)."""
    out: dict[str, Limit] = {}
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        parts = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        for part in parts:
            for meta in getattr(part, "__metadata__", ()):
                if isinstance(meta, Limit):
                    out[name] = meta
    return out


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


def coerce(value: Any, tp: Any, key: str) -> Any:
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
                return coerce(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key {key!r}: {value!r} does not match {tp}")
    if origin is typing.Literal:
        for allowed in typing.get_args(tp):
            if value == allowed or (isinstance(value, str) and value == str(allowed)):
                return allowed
        raise ConfigError(f"config key {key!r}: {value!r} is not one of {typing.get_args(tp)}")
    if origin in (tuple, list):
        if isinstance(value, str):  # "a,b" or "[a,b]" from the command line
            text = value.strip()
            text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            value = [v.strip() for v in text.split(",") if v.strip() != ""]
        elif not isinstance(value, (list, tuple)):
            value = [value]  # a single value is a one-element sequence
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [coerce(v, inner, key) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as error:
                raise ConfigError(f"config key {key!r}: {value!r} is not a YAML mapping ({_yaml_problem(error)}); "
                                  f"write it as {key}={{a: 1, b: x}} (quoted in a shell) or set one entry as "
                                  f"{key}.a=1") from None
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
    """Return a copy of dataclass `cfg` with nested `values` applied (type-checked, limits checked)."""
    hints, limits = _hints(type(cfg)), field_limits(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if k not in names:
            moved = getattr(type(cfg), "moved_keys", {}).get(k)
            if moved:
                raise ConfigError(f"config key {key!r} moved to {moved!r}: write {moved}=...")
            raise ConfigError(f"unknown config key {key!r}; valid keys here: {sorted(names)}")
        current = getattr(cfg, k)
        if dataclasses.is_dataclass(current):
            if not isinstance(v, dict):
                raise ConfigError(f"config key {key!r} is a section; give sub-keys like {key}.<name>=...")
            variants = union_variants(hints[k])
            changes[k] = (_apply_variant(current, v, key, variants) if variants
                          else apply_dict(current, v, prefix=key + "."))
        else:
            changes[k] = coerce(v, hints[k], key)
            if k in limits:
                limits[k].check(key, changes[k])
            # a mapping merges (YAML, then the command line)
            if isinstance(current, dict) and isinstance(changes[k], dict):
                changes[k] = {**current, **changes[k]}
    return dataclasses.replace(cfg, **changes)


def union_variants(tp: Any) -> dict[str, type] | None:
    """{name: class} when `tp` is a union of dataclasses that each fix `name` to one `Literal` value
    (a discriminated union such as the job's `algo`, picked by `algo.name`); else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    out = {}
    for cls in typing.get_args(tp):
        tag = typing.get_args(typing.get_type_hints(cls).get("name")) if dataclasses.is_dataclass(cls) else ()
        if len(tag) != 1:
            return None
        out[tag[0]] = cls
    return out


def _not_taken(key: str, field: str, value: Any, tag: str, variants: dict[str, type]) -> ConfigError:
    """The error for `key.field`, which the class `key.name=tag` picks has no field for."""
    takers = sorted(t for t, cls in variants.items() if field in {f.name for f in dataclasses.fields(cls)})
    if not takers:
        valid = sorted(f.name for f in dataclasses.fields(variants[tag]))
        return ConfigError(f"unknown config key {key}.{field!r}; valid keys with {key}.name={tag}: {valid}")
    try:  # shown as the field's type reads it (the command line's "0.1" is 0.1)
        value = coerce(value, _hints(variants[takers[0]])[field], f"{key}.{field}")
    except ConfigError:
        pass
    return ConfigError(f"{key}.{field}={value} is not read by {key}.name={tag} (it is by {takers}); unset it "
                       f"(~{key}.{field} on the command line) or choose one of those")


def switch_variant(current: Any, cls: type, key: str, variants: dict[str, type]) -> Any:
    """`current` as an instance of the union member `cls`: each field the user changed from its class's
    default is carried (or refused where `cls` has no such field); the rest take `cls`'s own defaults."""
    names, defaults = {f.name for f in dataclasses.fields(cls)}, type(current)()
    carried = {}
    for f in dataclasses.fields(current):
        value = getattr(current, f.name)
        if f.name == "name" or value == getattr(defaults, f.name):
            continue
        if f.name not in names:
            raise _not_taken(key, f.name, value, cls().name, variants)
        carried[f.name] = value
    return cls(**carried)


def _apply_variant(current: Any, values: dict[str, Any], key: str, variants: dict[str, type]) -> Any:
    """`values` applied to the discriminated-union section `current`, switching class if `name` changes."""
    tag = coerce(values.get("name", current.name), typing.Literal[tuple(variants)], f"{key}.name")
    cls = variants[tag]
    names = {f.name for f in dataclasses.fields(cls)}
    for field, value in values.items():
        if field not in names:
            raise _not_taken(key, field, value, tag, variants)
    base = current if type(current) is cls else switch_variant(current, cls, key, variants)
    return apply_dict(base, {k: v for k, v in values.items() if k != "name"}, prefix=key + ".")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": "1"}, "c": "x"}`: values stay text until the field type converts them."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value (a value with spaces, such as a mapping "
                              "{a: 1, b: 2}, goes in quotes: 'key.sub={a: 1, b: 2}')")
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
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(error)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    return data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML parse error in one line: what the parser found, and where (PyYAML's own text spans several)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


RECIPE_PREFIX = "recipe:"
"""`config=recipe:NAME` names a recipe shipped in the package (rayllm_rl/recipes/NAME.yaml)."""


def packaged_recipes() -> dict[str, Path]:
    """The recipes shipped in the package, by name (file stem), sorted."""
    return {p.stem: p for p in sorted((Path(__file__).parent / "recipes").glob("*.yaml"))}


def config_file(spec: str) -> Path:
    """The file `config=spec` names: `recipe:NAME` a packaged recipe (an unknown name fails listing them and the
    close ones), anything else a path."""
    if not spec.startswith(RECIPE_PREFIX):
        return Path(spec)
    name = spec[len(RECIPE_PREFIX):].removesuffix(".yaml")
    recipes = packaged_recipes()
    if name not in recipes:
        import difflib

        close = difflib.get_close_matches(name, recipes, n=2, cutoff=0.5)
        raise ConfigError(f"config={spec}: no such recipe" + (f" (close: {close})" if close else "")
                          + f"; the recipes: {', '.join(recipes)} (`rayllm-rl recipes`)")
    return recipes[name]


def unset_key(cfg: T, key: str) -> T:
    """`cfg` with `key` (dotted) back at the default of the class that holds it: the command line's `~key`, which
    takes back a value a YAML file set (e.g. a recipe's `algo.prox_logp_method`, before `algo.name=grpo`)."""
    parts = key.split(".")
    nodes = [cfg]
    for i, part in enumerate(parts):
        node = nodes[-1]
        fields = {f.name for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else set()
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"~{key}: {where} has no key {part!r}"
                              + (f" (its keys: {sorted(fields)})" if fields else ""))
        if i < len(parts) - 1:
            nodes.append(getattr(node, part))
    value = getattr(type(nodes[-1])(), parts[-1])
    for node, part in zip(reversed(nodes), reversed(parts)):
        value = dataclasses.replace(node, **{part: value})
    return value


def load_config(cls: type[T], argv: list[str] | None = None, *, config_key: str = "config") -> T:
    """Defaults of `cls`, then the YAML file given as `config=path.yaml` (or `config=recipe:NAME`, a packaged
    recipe), then `~key` items (`unset_key`), then overrides. What the user wrote, nothing more: fields left to a
    preset stay None until the job's `validate()` resolves them (GRPOJobConfig: `presets.resolve_presets`, which
    returns a new config)."""
    cfg, overrides = _before_overrides(cls, argv, config_key)
    return apply_dict(cfg, parse_overrides(overrides))


def _before_overrides(cls: type[T], argv: list[str] | None, config_key: str) -> tuple[T, list[str]]:
    """`load_config` up to the overrides: (the defaults, the files and the `~key` items applied; the `key=value`
    items left)."""
    argv = list(argv or [])
    cfg = cls()
    files = [a.split("=", 1)[1] for a in argv if a.startswith(f"{config_key}=")]
    for f in files:
        cfg = apply_dict(cfg, load_yaml(config_file(f)))
    rest = [a for a in argv if not a.startswith(f"{config_key}=")]
    for item in (a for a in rest if a.startswith("~")):
        cfg = unset_key(cfg, item[1:].strip())
    return cfg, [a for a in rest if not a.startswith("~")]


def merged_mappings(cls: type, argv: list[str] | None, *,
                    config_key: str = "config") -> dict[str, tuple[dict, list[str]]]:
    """The mappings of `load_config(cls, argv)` that a command-line override merged into (`apply_dict`) where a
    config file had already set them: {dotted key: (what the file set, the override items that merged into it)}.
    What an error about such a key is told (`cli.config_error_message`): the file's entries stayed, and `~key`
    first replaces the mapping instead. {} when `argv` cannot be read that far."""
    try:
        cfg, overrides = _before_overrides(cls, argv, config_key)
        parsed = parse_overrides(overrides)
    except (ValueError, TypeError):
        return {}
    out: dict[str, tuple[dict, list[str]]] = {}

    def walk(node: Any, values: dict[str, Any], prefix: str) -> None:
        for name, value in values.items():
            current = getattr(node, name, None)
            key = f"{prefix}{name}"
            if dataclasses.is_dataclass(current) and isinstance(value, dict):
                walk(current, value, key + ".")
            elif isinstance(current, dict) and current and current != getattr(type(node)(), name):
                items = [a for a in overrides if a.split("=", 1)[0].strip() == key
                         or a.split("=", 1)[0].strip().startswith(key + ".")]
                out[key] = (dict(current), items)

    try:
        walk(cfg, parsed, "")
    except (ValueError, TypeError):  # a section whose class cannot be made bare: no hint
        return {}
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def describe(cfg: Any, prefix: str = "") -> str:
    """Every key with its default value and docstring (for `--help`); a discriminated-union section
    shows the chosen class's keys, then what each other `name` takes."""
    lines = []
    docs, hints = field_docs(type(cfg)), _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            lines.append(f"{key}: {docs.get(f.name, '')}")
            lines.append(describe(value, prefix=key + "."))
            variants = union_variants(hints[f.name]) or {}
            shared = set.intersection(*({g.name for g in dataclasses.fields(c)} for c in variants.values())) \
                if variants else set()
            for tag, cls in variants.items():  # each member's own keys, with its defaults
                own = ", ".join(f"{g.name}={getattr(cls(), g.name)!r}" for g in dataclasses.fields(cls)
                                if g.name not in shared)
                lines.append(f"  {key}.name={tag} takes: {own or '(no other key)'}")
        else:
            lines.append(f"  {key}={value!r}  {docs.get(f.name, '')}")
    return "\n".join(lines)


def check_fields(cfg: Any, prefix: str = "") -> None:
    """Every `Literal` field of a (nested) config dataclass holds an allowed value and every number is
    within its `Limit`: catches values set in Python, which never pass through the YAML/command-line
    parser. Raises ConfigError naming the key, the value and what is allowed."""
    hints, limits = typing.get_type_hints(type(cfg)), field_limits(type(cfg))
    for f in dataclasses.fields(cfg):
        value, tp, key = getattr(cfg, f.name), hints.get(f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_fields(value, key + ".")
            continue
        allowed = _literal_values(tp)
        if allowed is not None and value not in allowed:
            raise ConfigError(f"config key {key!r}: {value!r} is not one of {allowed}")
        if f.name in limits:
            limits[f.name].check(key, value)


def _literal_values(tp: Any) -> tuple | None:
    """The values a `Literal[...]` (or `Literal[...] | None`) field allows, else None."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [_literal_values(a) for a in typing.get_args(tp) if a is not type(None)]
        if inner and all(v is not None for v in inner):
            return tuple(x for v in inner for x in v) + ((None,) if type(None) in typing.get_args(tp) else ())
    return None
