"""Inference engines behind the gateway, chosen by `EngineConfig.kind` from `ENGINES`.

`local` is the embedded torch engine (`LocalEngine`); `sglang` is a `Router` over one
`SGLangEngine` client per URL (session-sticky, least-loaded). Kinds are registered by a lazy
entry point (`gateway/registry.py`) that builds the engine from `(EngineConfig, model_path)`;
implementations are imported when built, so a missing optional module never breaks the other
kind. A new kind is a module with such a builder (or a class taking those two arguments) and one
`ENGINES.register` line here, with `remote=True` when what is built is a client of engines that
run elsewhere (servers at `urls`), which there is no point in moving to another process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gateway.engines.base import Engine
from gateway.registry import Registry

ENGINES: Registry[Engine] = Registry("engine.kind")
ENGINES.register("local", "gateway.engines:local_engine", remote=False)
ENGINES.register("sglang", "gateway.engines:sglang_router", remote=True)


@dataclass
class EngineConfig:
    kind: str = "local"
    """`local`: the embedded torch engine in this process; `sglang`: clients of SGLang servers."""
    urls: list[str] = field(default_factory=list)
    """SGLang server base URLs (kind=sglang), e.g. [http://10.0.0.5:30000]."""
    dtype: str = "float32"
    """Weights dtype of the local engine (float32, bfloat16, float16)."""
    max_batch_size: int = 32
    """Most sequences the local engine decodes together."""
    max_context: int | None = None
    """Longest prompt + output of the local engine; None = the model's own limit."""

    def __post_init__(self) -> None:
        ENGINES.check(self.kind)
        if self.kind == "sglang" and not self.urls:
            raise ValueError("engine.urls: kind=sglang needs at least one SGLang server URL")
        if self.max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size must be >= 1, got {self.max_batch_size}")


def make_engine(cfg: EngineConfig, model_path: str | Path) -> Engine:
    """Build the engine `cfg` describes, for the model at `model_path` (local) or behind `urls`."""
    return ENGINES.build(cfg.kind, cfg, model_path)


def local_engine(cfg: EngineConfig, model_path: str | Path) -> Engine:
    from gateway.engines.local import LocalEngine

    return LocalEngine(
        str(model_path),
        dtype=cfg.dtype,
        max_batch_size=cfg.max_batch_size,
        max_context=cfg.max_context,
    )


def sglang_router(cfg: EngineConfig, model_path: str | Path) -> Engine:
    from gateway.engines.router import Router
    from gateway.engines.sglang import SGLangEngine

    return Router([SGLangEngine(url) for url in cfg.urls])
