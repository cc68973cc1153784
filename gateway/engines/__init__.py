"""Inference engines behind the gateway, chosen by `EngineConfig.kind` from `ENGINES`.

`local` is the embedded torch engine (`LocalEngine`); `sglang` is an `SGLangEngine` client of
one server. An `EngineConfig` describes one engine or several (`replicas` local engines, one
SGLang engine per URL): `replica_configs` lists one config per engine, `make_engines` builds
them, and several engines stand behind one `Router` (session-sticky, least-loaded), which is
itself an Engine: `make_engine` returns the engine or that router. Kinds are registered by a
lazy entry point (`gateway/registry.py`) that builds one engine from `(EngineConfig,
model_path)`; implementations are imported when built, so a missing optional module never breaks
the other kind. A new kind is a module with such a builder (or a class taking those two
arguments) and one `ENGINES.register` line here, with `remote=True` when what is built is a
client of engines that run elsewhere (servers at `urls`), which there is no point in moving to
another process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from gateway.engines.base import Engine
from gateway.registry import Registry

ENGINES: Registry[Engine] = Registry("engine.kind")
ENGINES.register("local", "gateway.engines:local_engine", remote=False)
ENGINES.register("sglang", "gateway.engines:sglang_engine", remote=True)


@dataclass
class EngineConfig:
    kind: str = "local"
    """`local`: the embedded torch engine in this process; `sglang`: clients of SGLang servers."""
    urls: list[str] = field(default_factory=list)
    """SGLang server base URLs (kind=sglang), e.g. [http://10.0.0.5:30000]."""
    dtype: str = "float32"
    """Weights dtype of the local engine (float32, bfloat16, float16)."""
    max_batch_size: int = 64
    """Most sequences the local engine decodes together (a decode step at 64 rows made 1.3x
    the tokens/s of one at 32 on a 2-core Xeon, README; its KV cache grows only as rows come)."""
    max_context: int | None = None
    """Longest prompt + output of the local engine; None = the model's own limit."""
    replicas: int = 1
    """Local engines to run (each its own process with ray.enabled), behind one router; SGLang
    runs one engine per URL."""

    def __post_init__(self) -> None:
        ENGINES.check(self.kind)
        if self.kind == "sglang" and not self.urls:
            raise ValueError("engine.urls: kind=sglang needs at least one SGLang server URL")
        if self.max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.replicas < 1:
            raise ValueError(f"engine.replicas must be >= 1, got {self.replicas}")
        if self.kind == "sglang" and self.replicas != 1:
            raise ValueError("engine.replicas: kind=sglang runs one engine per URL in engine.urls")


def replica_configs(cfg: EngineConfig) -> list[EngineConfig]:
    """One config per engine `cfg` describes (each with replicas=1 and at most one URL)."""
    if cfg.urls:
        return [dataclasses.replace(cfg, urls=[url]) for url in cfg.urls]
    return [dataclasses.replace(cfg, replicas=1) for _ in range(cfg.replicas)]


def make_engines(cfg: EngineConfig, model_path: str | Path) -> list[Engine]:
    """Every engine `cfg` describes, for the model at `model_path` (local) or behind `urls`."""
    return [ENGINES.build(c.kind, c, model_path) for c in replica_configs(cfg)]


def make_engine(cfg: EngineConfig, model_path: str | Path) -> Engine:
    """The engine `cfg` describes, or a `Router` over them when it describes several."""
    return serve_together(make_engines(cfg, model_path))


def serve_together(engines: list[Engine]) -> Engine:
    """One engine for the gateway: the engine itself, or a `Router` over several."""
    if len(engines) == 1:
        return engines[0]
    from gateway.engines.router import Router

    return Router(engines)


def local_engine(cfg: EngineConfig, model_path: str | Path) -> Engine:
    from gateway.engines.local import LocalEngine

    return LocalEngine(
        str(model_path),
        dtype=cfg.dtype,
        max_batch_size=cfg.max_batch_size,
        max_context=cfg.max_context,
    )


def sglang_engine(cfg: EngineConfig, model_path: str | Path) -> Engine:
    from gateway.engines.sglang import SGLangEngine

    (url,) = cfg.urls  # replica_configs gives each SGLang engine its one URL
    return SGLangEngine(url)
