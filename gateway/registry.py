"""Registries of kinds: how every swappable part (engine, train backend, weight route, sandbox,
agent) is chosen by the `kind` field of its config, as Gymnasium registers envs.

    ENGINES = Registry("engine.kind")
    ENGINES.register("local", "gateway.engines:local_engine", remote=False)
    engine = ENGINES.build(cfg.kind, cfg, model_path)

A kind maps to a lazy `"module:attr"` entry point (a class, or a function that builds one from
the part's config), imported only when that kind is built, so a kind whose optional
dependencies are missing never breaks the others. Optional attributes (`**attrs`) describe a
kind without importing it. Adding a kind is one module and one `register` line beside the
part's Protocol; nothing outside a registry branches on a kind string.

An unknown kind is a `ConfigError` that names the registered kinds and the closest match.
Each part's config checks its kind in `__post_init__`, so a recipe fails when it is loaded.
This module lives in `gateway` because every package may import `gateway` (the base of the
import graph), like the config loader it shares `ConfigError` with.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from gateway.config import ConfigError

T = TypeVar("T")


def closest(name: str, options: list[str]) -> str | None:
    """The option most like `name` (difflib's default cutoff), or None."""
    found = difflib.get_close_matches(name, options, n=1)
    return found[0] if found else None


class Registry(Generic[T]):
    """Kind name -> lazy entry point, for the part whose config key is `key`."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: dict[str, str] = {}
        self._attrs: dict[str, dict[str, Any]] = {}

    def register(self, kind: str, entry_point: str, **attrs: Any) -> None:
        """Register `kind` as `"module:attr[.attr]"`; `attrs` describe it without importing it."""
        module, sep, attr = entry_point.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"entry point {entry_point!r}: write it as 'module:attr'")
        if kind in self._entries:
            raise ValueError(f"{self.key}: kind {kind!r} is already registered")
        self._entries[kind] = entry_point
        self._attrs[kind] = attrs

    def kinds(self) -> list[str]:
        return sorted(self._entries)

    def check(self, kind: str) -> None:
        """ConfigError naming the registered kinds (and the closest one) unless `kind` is one."""
        if kind in self._entries:
            return
        near = closest(kind, self.kinds())
        hint = f"; did you mean {near!r}?" if near else ""
        raise ConfigError(
            f"{self.key}: {kind!r} is not a registered kind{hint} "
            f"(registered: {', '.join(self.kinds())})"
        )

    def attrs(self, kind: str) -> dict[str, Any]:
        self.check(kind)
        return self._attrs[kind]

    def load(self, kind: str) -> Callable[..., T]:
        """Import `kind`'s entry point."""
        self.check(kind)
        module, _, path = self._entries[kind].partition(":")
        obj: Any = importlib.import_module(module)
        for name in path.split("."):
            obj = getattr(obj, name)
        return obj

    def build(self, kind: str, *args: Any, **kwargs: Any) -> T:
        """`kind`'s entry point called with the part's config (and whatever else it needs)."""
        return self.load(kind)(*args, **kwargs)
