"""Sandboxes for black-box agents: `open_sandbox(SandboxConfig(kind="docker"|"local"))`.

See `sandbox/base.py` for the interface, `sandbox/docker_backend.py` and
`sandbox/local_backend.py` for what each backend isolates (and what it does not),
`sandbox/forwarder.py` for the in-sandbox way out to the gateway, `python -m sandbox.run` and
`python -m sandbox.image build` for the command lines.
"""

from sandbox.base import (
    SANDBOXES,
    RunResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    Stopper,
    open_sandbox,
    run_once,
    stop_all,
    unavailable,
)

__all__ = [
    "SANDBOXES",
    "RunResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "Stopper",
    "open_sandbox",
    "run_once",
    "stop_all",
    "unavailable",
]
