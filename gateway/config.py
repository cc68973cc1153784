"""Typed configuration: dataclasses with field docstrings, YAML recipes, `key.sub=value` overrides.

Every component owns its config as a dataclass; a field's docstring (the string literal right
after it) is its only help text. `load_config` builds a config from defaults, an optional YAML
file and a command-line dotlist, and rejects unknown keys with the closest valid key. It lives in
`gateway` because every package may import `gateway` (the base of the import graph), and
`gateway.serve`, `sandbox.run`, `envs.eval` and `trainer.run` all parse their arguments with it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or an override is wrong; the message says which key and what to do."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (base classes included)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per leaf field: `key = default  # doc`, recursing into nested configs."""
    lines: list[str] = []
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        sub = _dataclass_type(hints[f.name])
        if sub is not None:
            lines.extend(describe(sub, key + "."))
            continue
        named = _named_dataclass_type(hints[f.name])
        if named is not None:
            lines.append(f"{key} = {{}}  # {docs.get(f.name, '')}")
            lines.extend(describe(named, key + ".<name>."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        lines.append(f"{key} = {default!r}  # {docs.get(f.name, '')}")
    return lines


def load_config(cls: type[T], recipe: str | Path | None = None, overrides: list[str] = ()) -> T:
    """Defaults of `cls`, then the YAML file `recipe`, then `key.sub=value` overrides."""
    data: dict[str, Any] = {}
    if recipe is not None:
        text = Path(recipe).read_text()
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{recipe}: not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{recipe}: a recipe must be a mapping of config keys")
        data = loaded
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: write it as key=value (for example port=8001)")
        _set_path(data, key.split("."), yaml.safe_load(raw) if raw else "")
    return from_dict(cls, data)


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a nested mapping, checking keys and types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else ""
            valid = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {prefix}{key}{hint} (valid keys here: {valid})")
        sub = _dataclass_type(hints[key])
        if sub is not None and (isinstance(value, dict) or value is None):
            kwargs[key] = from_dict(sub, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}")
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from None
    return obj


def to_dict(obj: Any) -> Any:
    """Plain nested dict of a config (for YAML dumps and run directories)."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def dump_yaml(obj: Any, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))


def _set_path(data: dict[str, Any], keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        nxt = data.get(k)
        if not isinstance(nxt, dict):
            nxt = data[k] = {}
        data = nxt
    data[keys[-1]] = value


def _dataclass_type(tp: Any) -> type | None:
    """The config dataclass `tp` is, or is optionally (`X | None`); None otherwise."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None


def _named_dataclass_type(tp: Any) -> type | None:
    """X for `dict[str, X]` with X a config dataclass (named sub-configs); None otherwise."""
    if typing.get_origin(tp) is dict:
        return _dataclass_type(typing.get_args(tp)[1])
    return None


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; int -> float and scalar -> list are allowed."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, args))}")
    if origin in (list, tuple):
        items = value if isinstance(value, list | tuple) else [value]
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(items)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        key_tp, value_tp = args or (Any, Any)
        out = {}
        for k, v in value.items():
            try:
                out[_coerce(k, key_tp, f"{key} (a key)")] = _coerce(v, value_tp, f"{key}.{k}")
            except ConfigError as e:
                if v is None and ":" in str(k):  # YAML: `{a:b}` is the key 'a:b' with no value
                    raise ConfigError(
                        f"{e}; write `{{a: b}}`, with a space after the colon"
                    ) from None
                raise
        return out
    if _dataclass_type(tp) is not None and isinstance(value, dict):
        return from_dict(_dataclass_type(tp), value, f"{key}.")
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads `1e-4` (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if (
        isinstance(tp, type)
        and not isinstance(value, tp)
        or (tp is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {value!r}")
    return value


def parse_cli(cls: type[T], argv: list[str], recipe_dir: Path | None = None) -> T:
    """Parse `[recipe=NAME|PATH] key=value ...`; `--help` prints every key with its doc and exits.

    `recipe=NAME` finds `recipe_dir/NAME.yaml`; anything else is taken as a path.
    """
    if any(a in ("-h", "--help", "help") for a in argv):
        print("\n".join(describe(cls)))
        raise SystemExit(0)
    recipe = None
    overrides = []
    for arg in argv:
        if arg.startswith("recipe="):
            recipe = _find_recipe(arg.removeprefix("recipe="), recipe_dir)
        else:
            overrides.append(arg)
    return load_config(cls, recipe, overrides)


def _find_recipe(name: str, recipe_dir: Path | None) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    if recipe_dir is not None:
        candidate = recipe_dir / f"{name}.yaml"
        if candidate.is_file():
            return candidate
        known = sorted(p.stem for p in recipe_dir.glob("*.yaml"))
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean recipe={close[0]}?" if close else ""
        raise ConfigError(f"recipe {name!r} not found{hint} (known recipes: {', '.join(known)})")
    raise ConfigError(f"recipe {name!r}: no such file")
