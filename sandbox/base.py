"""The sandbox interface: config, run result, the backend Protocol, and `open_sandbox`.

A sandbox is a place where one untrusted program (a black-box agent) runs with limits (memory,
CPUs, processes, wall time), no network, and one way out: the gateway, whose Unix socket is bound
in and exposed inside at `http://127.0.0.1:PORT/v1` by `sandbox/forwarder.py`. Files go in and
out of a private work dir; stdout/stderr are captured.

    cfg = SandboxConfig(kind="docker", gateway_socket="/run/gw.sock")
    with open_sandbox(cfg) as sb:
        sb.put_files({"agent.py": code})
        res = sb.run(["python3", "agent.py"], env={"OPENAI_API_KEY": session_key})
        files = sb.get_files(["answer.txt"])

Backends (chosen by `kind`, registered in `SANDBOXES` by a lazy entry point: a class built from
the `SandboxConfig`): `docker` (`sandbox/docker_backend.py`) and `local`
(`sandbox/local_backend.py`: bubblewrap, or a bare process group). Each module's docstring says
what isolation it does *not* give.

A misbehaving agent is data, not an exception: `run` returns a `RunResult` whose `status` is
`ok` (exit code 0), `error` (non-zero exit, or the sandbox could not run it), `timeout` (wall
time) or `killed` (a limit: memory, pids, cpu time, file size), with a human-readable `reason`.
`SandboxError` is raised only when a sandbox cannot be opened (Docker down, image missing, bad
gateway socket); `ValueError` for a bad config.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol

from gateway.registry import Registry

log = logging.getLogger("loongsage.sandbox")

DEFAULT_IMAGE = "loongsage-sandbox:latest"
Status = Literal["ok", "timeout", "killed", "error"]

SANDBOXES: Registry[Sandbox] = Registry("sandbox.kind")
SANDBOXES.register("docker", "sandbox.docker_backend:DockerSandbox")
SANDBOXES.register("local", "sandbox.local_backend:LocalSandbox")


class SandboxError(RuntimeError):
    """A sandbox could not be opened or used; the message says what to do."""


@dataclasses.dataclass
class SandboxConfig:
    kind: str = "local"
    """Backend: `docker` (a container per run) or `local` (bubblewrap if present, else a bare process group)."""
    image: str = DEFAULT_IMAGE
    """Docker image (needs `python3` when a gateway is wired); build the default with `python -m sandbox.image build`."""
    memory_mb: int = 1024
    """Memory limit in MiB (docker: cgroup for the whole run; local: RLIMIT_DATA per process)."""
    cpus: float = 1.0
    """CPU limit (docker: CPU quota; local: affinity to ceil(cpus) cores and an RLIMIT_CPU backstop)."""
    pids: int = 128
    """Max processes/threads (docker: pids cgroup; local: RLIMIT_NPROC of a per-sandbox uid)."""
    timeout_s: float = 300.0
    """Default wall-time limit of one `run`, seconds."""
    disk_mb: int = 512
    """Size of the writable work dir (docker: tmpfs size; local: RLIMIT_FSIZE per file)."""
    gateway_socket: str | None = None
    """Host path of the gateway's Unix socket to expose inside; None = no way out at all."""
    gateway_port: int = 8000
    """Port the in-sandbox forwarder listens on (127.0.0.1); 0 = any free port."""
    gateway_path: str = "/v1"
    """Path appended to the forwarder's address in OPENAI_BASE_URL (e.g. /sessions/ID/v1)."""
    api_key: str = "EMPTY"
    """Default OPENAI_API_KEY inside (a per-session key passed to `run(env=...)` overrides it)."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra environment variables for every run."""
    output_limit_bytes: int = 1 << 20
    """Keep at most this many trailing bytes of stdout and of stderr per run."""
    local_isolation: Literal["auto", "bwrap", "process"] = "auto"
    """local backend: `bwrap` (namespaces), `process` (rlimits only, less isolation), `auto` = bwrap when installed."""
    ro_binds: list[str] = dataclasses.field(default_factory=list)
    """Host paths (absolute) the agent may read, at the same path inside, e.g. an agent's own venv; a venv's base Python (pyvenv.cfg `home`) comes with it. local: bound read-only (bwrap) or made reachable by the sandbox uid (process mode as root); docker: read-only bind mounts (folders above them are the image's)."""

    def __post_init__(self) -> None:
        SANDBOXES.check(self.kind)
        positive = ("memory_mb", "cpus", "pids", "timeout_s", "disk_mb", "output_limit_bytes")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.gateway_port < 65536:
            raise ValueError(f"sandbox.gateway_port must be in 0..65535, got {self.gateway_port}")
        if not self.gateway_path.startswith("/"):
            raise ValueError(f"sandbox.gateway_path must start with '/', got {self.gateway_path!r}")
        for path in self.ro_binds:
            if not os.path.isabs(path):
                raise ValueError(f"sandbox.ro_binds: {path!r} must be an absolute host path")


@dataclasses.dataclass
class RunResult:
    status: Status
    """ok (exit 0) | error (non-zero exit or could not run) | timeout (wall time) | killed (a limit)."""
    exit_code: int | None
    """The command's exit code (128+N for signal N); None when it never ran."""
    reason: str
    """Why it ended like this, for people and for aborted trajectories ('' when ok)."""
    duration_s: float
    """Wall time of the run."""
    stdout: str
    """Captured stdout (the last `output_limit_bytes`)."""
    stderr: str
    """Captured stderr (the last `output_limit_bytes`)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def summary(self, tail_chars: int = 2000) -> dict:
        """The JSON line `python -m sandbox.run` prints."""
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "duration_s": round(self.duration_s, 3),
            "stdout_tail": self.stdout[-tail_chars:],
            "stderr_tail": self.stderr[-tail_chars:],
        }


class Sandbox(Protocol):
    """What every backend implements. `start` may fail half way; `stop` must still clean up."""

    isolation: str
    """One line saying what this sandbox isolates (shown in logs and in `python -m sandbox.run`)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def put_files(self, files: dict[str, str | bytes]) -> None: ...
    def get_files(self, paths: list[str]) -> dict[str, bytes]: ...
    def run(
        self, cmd: list[str], timeout_s: float | None = None, env: dict[str, str] | None = None
    ) -> RunResult: ...


def unavailable(cfg: SandboxConfig) -> str:
    """'' when a sandbox of `cfg` can open here, else why not and what to do; cheap, for failing
    before a run loads anything. A backend class with such a check defines a static
    `unavailable(cfg) -> str`; the others can always try."""
    check = getattr(SANDBOXES.load(cfg.kind), "unavailable", None)
    return check(cfg) if check is not None else ""


@contextlib.contextmanager
def open_sandbox(cfg: SandboxConfig) -> Iterator[Sandbox]:
    """Start a sandbox of `cfg.kind`; everything it started is stopped on exit, even if start failed."""
    sb = SANDBOXES.build(cfg.kind, cfg)
    _live.add(sb)
    try:
        sb.start()
        log.info("sandbox started: %s", sb.isolation)
        yield sb
    finally:
        try:
            sb.stop()
        finally:
            _live.discard(sb)


def run_once(
    cfg: SandboxConfig,
    cmd: list[str],
    files: dict[str, str | bytes] | None = None,
    env: dict[str, str] | None = None,
    collect: list[str] = (),
    timeout_s: float | None = None,
    stopper: Stopper | None = None,
) -> tuple[RunResult, dict[str, bytes]]:
    """One rollout of a black-box agent: a fresh sandbox, `files` in, `cmd`, `collect` out.

    Never raises for a sandbox that cannot start or fails mid-way: that comes back as a
    `status="error"` result (a bad rollout is data), with no files. Per-rollout settings go in
    `env` (e.g. the session's `OPENAI_API_KEY`) or in a copy of `cfg`
    (`dataclasses.replace(cfg, gateway_path=f"/sessions/{sid}/v1")`). Blocking; from async code
    call it with `asyncio.to_thread`; `stopper.stop()`, from any thread, ends it early (an
    `error` result "stopped"), e.g. when the caller's task is cancelled.
    """
    try:
        with open_sandbox(cfg) as sb:
            if stopper is not None and not stopper.attach(sb):
                return RunResult("error", None, "sandbox: stopped", 0.0, "", ""), {}
            if files:
                sb.put_files(files)
            result = sb.run(cmd, timeout_s=timeout_s, env=env)
            return result, sb.get_files(list(collect)) if collect else {}
    except (SandboxError, OSError) as e:
        return RunResult("error", None, f"sandbox: {e}", 0.0, "", ""), {}


class Stopper:
    """Stops a `run_once` in progress from another thread: its sandbox is stopped (its `run`
    returns at once), or, when `stop` comes first, the command never starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sandbox: Sandbox | None = None
        self.stopped = False

    def attach(self, sb: Sandbox) -> bool:
        """Called by run_once once `sb` is open; False when already stopped."""
        with self._lock:
            self._sandbox = sb
            return not self.stopped

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            sb = self._sandbox
        if sb is not None:
            sb.stop()


_live: set = set()


@atexit.register
def stop_all() -> None:
    """Stop every sandbox open in this process; their blocked `run` calls return at once.

    A run that is shutting down calls it so that the threads running sandboxes are not waited
    for until their agents time out; atexit calls it too, so no container or process outlives
    the controller (an exception escaped a thread, sys.exit in a worker, ...)."""
    for sb in list(_live):
        with contextlib.suppress(Exception):
            sb.stop()


# ---- helpers shared by the backends ----

INSIDE_DIR = "/opt/loongsage"
INSIDE_SOCKET = f"{INSIDE_DIR}/gateway.sock"
INSIDE_FORWARDER = f"{INSIDE_DIR}/forwarder.py"
FORWARDER_FILE = Path(__file__).with_name("forwarder.py")


# Bound (local) or present (docker) anyway; never bound again from a venv's base Python.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


def outside_system_dirs(paths) -> list[str]:
    """`paths` without those in or under a system dir, in order, each once."""
    keep = [p for p in paths if not any(p == s or p.startswith(s + "/") for s in SYSTEM_DIRS)]
    return list(dict.fromkeys(keep))


def ro_bind_paths(cfg: SandboxConfig) -> list[str]:
    """`cfg.ro_binds` and the base Python of every venv among them; SandboxError if one is missing.

    A venv's `bin/python` is a link to the Python it was made from (pyvenv.cfg `home`), so
    binding the venv alone gives exit 127 inside; its base prefix comes along unless it is a
    system dir (bound anyway)."""
    out: list[str] = []
    for path in cfg.ro_binds:
        if not os.path.exists(path):
            raise SandboxError(f"sandbox.ro_binds: {path!r} does not exist on this host")
        out.append(path)
        out += outside_system_dirs(venv_base_prefixes(path))
    return list(dict.fromkeys(out))


def venv_base_prefixes(path: str) -> list[str]:
    """Install prefixes of the Python the venv at `path` was made from ([] when it is no venv):
    its `home` as written in pyvenv.cfg (a venv's python links there) and where that resolves."""
    cfg = Path(path, "pyvenv.cfg")
    if not cfg.is_file():
        return []
    prefixes = set()
    for line in cfg.read_text(errors="replace").splitlines():
        key, sep, value = (part.strip() for part in line.partition("="))
        if sep and key == "home":  # the base Python's bin dir
            prefixes |= {str(Path(value).parent), str(Path(os.path.realpath(value)).parent)}
        elif sep and key == "executable":  # the base Python itself (Python >= 3.11 writes it)
            prefixes.add(str(Path(os.path.realpath(value)).parent.parent))
    return sorted(prefixes)


def check_gateway_socket(path: str | None, other_uid: bool) -> None:
    """Fail early, with the fix, when the gateway socket is missing or not connectable inside.

    `other_uid`: the sandbox runs under a uid other than the socket's owner, so the socket needs
    write permission for others; as root we grant it (the gateway authenticates by session key).
    """
    if path is None:
        return
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SandboxError(
            f"sandbox.gateway_socket {path!r} does not exist; start the gateway with uds={path}"
        ) from None
    if not stat.S_ISSOCK(st.st_mode):
        raise SandboxError(f"sandbox.gateway_socket {path!r} is not a Unix socket")
    if other_uid and (st.st_mode & 0o006) != 0o006:
        if os.geteuid() == 0:
            os.chmod(path, st.st_mode | 0o006)
            log.warning("made gateway socket %s connectable by sandbox uids (o+rw)", path)
        else:
            raise SandboxError(
                f"sandbox.gateway_socket {path!r} is not connectable by other users; "
                "chmod o+rw it (the gateway checks session keys)"
            )


def agent_env(cfg: SandboxConfig, extra: dict[str, str] | None, home: str) -> dict[str, str]:
    """The environment of an agent: minimal, then cfg.env, then the gateway keys, then `extra`."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": home,
        "USER": "sandbox",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.update(cfg.env)
    if cfg.gateway_socket is not None:
        env["OPENAI_API_KEY"] = cfg.api_key
    env.update(extra or {})
    return env


def launcher(cfg: SandboxConfig, cmd: list[str], port: int, python: str = "python3") -> list[str]:
    """`cmd` wrapped in the forwarder when a gateway is wired, else `cmd` itself."""
    if not cmd:
        raise ValueError(
            "run: cmd must be a non-empty list of strings, e.g. ['python3', 'agent.py']"
        )
    if cfg.gateway_socket is None:
        return list(cmd)
    return [python, INSIDE_FORWARDER, "--socket", INSIDE_SOCKET, "--port", str(port)] + [
        "--path",
        cfg.gateway_path,
        "--",
        *cmd,
    ]


def safe_relpath(rel: str) -> str:
    """A relative path that stays inside the work dir, or ValueError."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts:
        raise ValueError(f"file path {rel!r}: use a relative path inside the work dir (no '..')")
    return str(p)


def tail(data: bytes, limit: int) -> str:
    return data[-limit:].decode("utf-8", errors="replace")


MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory")


def signal_reason(code: int) -> str:
    """`exit 137 (SIGKILL)` style text for exit codes > 128."""
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"exit {code} ({signal.Signals(code - 128).name})"
    return f"exit {code}"


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""
