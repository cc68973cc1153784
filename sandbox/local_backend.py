"""`local` sandbox backend: bubblewrap namespaces when `bwrap` is installed, else a process group.

Each run is `taskset ... prlimit ... bwrap ... python3 forwarder.py ... -- CMD`, in its own
session:

- **bwrap** (`local_isolation=bwrap`, the default when installed): new pid, net, ipc, uts and
  cgroup namespaces (the net namespace has only its own loopback, so no network), the system
  dirs (`/usr`, `/etc`, `/lib*`, ...), this Python's prefix and `ro_binds` (an agent's own venv,
  with the Python it was made from) bound read-only, a private writable work dir at
  `/home/sandbox`, a fresh `/tmp`, `--die-with-parent`. Killing bwrap kills the whole pid
  namespace. Not root: a user namespace too (unprivileged bwrap). Root: bwrap runs privileged
  (so it can bind a Python that lives under `/root`) and the agent is dropped to the sandbox's
  own uid by `setpriv --no-new-privs` before anything of it runs.
- **process** (no bwrap): the command runs on the host in the work dir, in its own process
  group. It has the host's network and file system (read access as its uid). It is logged as
  less isolation, and `isolation` says so. The forwarder runs as a thread on the host (a free
  port of the shared loopback). As root the agent is dropped to the sandbox's uid by `setpriv`
  too, in a private mount namespace (`unshare --mount`) where each folder it may not enter but
  needs (this Python or a `ro_binds` venv under `/root`, 0700) is covered by a skeleton holding
  only those paths, read-only; the host's own folders are left as they are.

In both, `python3` is this interpreter (its agent libraries importable) and an agent in its own
venv runs as `VENV/bin/python` or `VENV/bin/TOOL` once the venv is in `ro_binds`.

Limits, in both: rlimits (RLIMIT_DATA = memory_mb per process, RLIMIT_NPROC = pids, RLIMIT_CPU as a
backstop of timeout_s x ceil(cpus), RLIMIT_FSIZE = disk_mb, no core files), CPU affinity to
ceil(cpus) cores, and a wall-time timeout that SIGKILLs the process group (and, as root, every
process of the sandbox's uid). When run as root, every sandbox gets its own uid
(1e9 + pid*256 + n), because RLIMIT_NPROC is not enforced for root and is counted per uid: a fork
bomb then exhausts only its own sandbox's budget.

What it does NOT give (use `docker` for these):
- memory is limited per process, not per sandbox: N processes may use N x memory_mb; an
  over-allocation shows up as a failed allocation (MemoryError) rather than an OOM kill, and
  `killed (memory)` is inferred from the exit and the stderr markers;
- no CPU share limit (affinity and CPU time only); no disk quota beyond the per-file size;
- when not root, RLIMIT_NPROC counts all processes of the user, so it is set to (current + pids);
- bwrap: the kernel, /proc/sys, and the read-only system dirs are shared with the host; the
  syscall surface is the host's (no seccomp filter);
- process mode: no network isolation at all, no file system isolation beyond Unix permissions,
  and a process that calls setsid() escapes the process-group kill (as root the per-uid kill
  still catches it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import resource  # imported here: the child, already under another uid, may not read it
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path, PurePosixPath

from sandbox.base import (
    FORWARDER_FILE,
    INSIDE_FORWARDER,
    INSIDE_SOCKET,
    MEMORY_MARKERS,
    SYSTEM_DIRS,
    RunResult,
    SandboxConfig,
    SandboxError,
    agent_env,
    check_gateway_socket,
    last_line,
    launcher,
    log,
    outside_system_dirs,
    ro_bind_paths,
    safe_relpath,
    signal_reason,
    tail,
)
from sandbox.forwarder import serve, unix_connector

_uid_counter = itertools.count()
_run_counter = itertools.count()
_core_counter = itertools.count()
# not /work: this Python may live under /work (a venv in a checkout) and is bound too
INSIDE_WORK = "/home/sandbox"


class LocalSandbox:
    """A work dir on the host and runs under bwrap (or a bare process group) with rlimits."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        bwrap = shutil.which("bwrap")
        if cfg.local_isolation == "bwrap" and bwrap is None:
            raise SandboxError(
                "sandbox.local_isolation=bwrap but bwrap is not installed: "
                "apt-get install bubblewrap, or use local_isolation=process (less isolation)"
            )
        self.bwrap = bwrap if cfg.local_isolation != "process" else None
        self.prlimit = shutil.which("prlimit")
        self.root: Path | None = None
        self.workdir: Path | None = None
        self.ro_paths: list[str] = []  # cfg.ro_binds and their venvs' base Pythons (start)
        # As root, a uid of its own per sandbox (see module docstring); otherwise our own uid.
        if os.geteuid() == 0:
            self.uid = 1_000_000_000 + os.getpid() * 256 + next(_uid_counter) % 256
        else:
            self.uid = os.geteuid()
        self.gid = self.uid if os.geteuid() == 0 else os.getegid()
        if self.bwrap:
            who = "own uid" if os.geteuid() == 0 else "user namespace"
            self.isolation = (
                f"local/bwrap: pid+net+ipc namespaces, read-only system, {who}, rlimits"
            )
        else:
            self.isolation = (
                "local/process: rlimits and a process group only; LESS ISOLATION "
                "(host network and file system visible)"
            )
        self._procs: set[subprocess.Popen] = set()
        self._listener: socket.socket | None = None  # process mode's host-side forwarder
        self._stop_lock = threading.Lock()

    # ---- lifecycle ----

    def start(self) -> None:
        if not self.bwrap:
            log.warning("sandbox: bwrap not used; %s", self.isolation)
        self.ro_paths = ro_bind_paths(self.cfg)
        sock = self.cfg.gateway_socket
        check_gateway_socket(sock, other_uid=self.bwrap is not None and self.uid != os.geteuid())
        if sock is not None and not self.bwrap:
            # No namespace to bind the socket into (and its folder may be closed to the sandbox
            # uid): forward from a thread here; the agent shares the host's loopback anyway.
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listener.bind(("127.0.0.1", 0))
            self._listener.listen(128)
            threading.Thread(
                target=serve, args=(self._listener, unix_connector(sock)), daemon=True
            ).start()
        self.root = Path(tempfile.mkdtemp(prefix="loongsage-sandbox-"))
        self.workdir = self.root / "work"
        self.workdir.mkdir()
        if os.geteuid() == 0:
            os.chown(self.workdir, self.uid, self.gid)
        # the root stays private (0700, ours); the sandbox uid only needs its work dir, which
        # bwrap binds in (process mode: we chdir into it, so the root must be traversable).
        os.chmod(self.root, 0o711)

    def stop(self) -> None:
        # `finally` and atexit may both stop one sandbox, from two threads
        with self._stop_lock:
            self._stop()

    def _stop(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        for proc in list(self._procs):
            self._kill(proc)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    # ---- files ----

    def put_files(self, files: dict[str, str | bytes]) -> None:
        work = self._work()
        for rel, content in files.items():
            rel_path = Path(safe_relpath(rel))
            path = work / rel_path
            _check_inside(path, work)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode() if isinstance(content, str) else content)
            if os.geteuid() == 0:  # the agent runs under the sandbox uid and may rewrite them
                for part in [rel_path, *rel_path.parents[:-1]]:
                    os.lchown(work / part, self.uid, self.gid)

    def get_files(self, paths: list[str]) -> dict[str, bytes]:
        """Regular files at `paths` (directories are expanded); missing ones are left out."""
        work = self._work()
        out: dict[str, bytes] = {}
        for rel in paths:
            path = work / safe_relpath(rel)
            if path.is_symlink() or not _inside(path, work):
                continue  # never follow a link the agent made out of its work dir
            if path.is_dir():
                for child in sorted(path.rglob("*")):
                    if child.is_file() and not child.is_symlink() and _inside(child, work):
                        out[str(child.relative_to(work))] = child.read_bytes()
            elif path.is_file():
                out[safe_relpath(rel)] = path.read_bytes()
        return out

    # ---- runs ----

    def run(
        self, cmd: list[str], timeout_s: float | None = None, env: dict[str, str] | None = None
    ) -> RunResult:
        cfg = self.cfg
        timeout = cfg.timeout_s if timeout_s is None else timeout_s
        work = self._work()
        assert self.root is not None
        argv, run_env = self._command(cmd, env, work, timeout)
        limits = self._rlimits(timeout)

        n = next(_run_counter)  # runs of one sandbox may overlap
        out_path, err_path = self.root / f"stdout.{n}", self.root / f"stderr.{n}"
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=work,
                    env=run_env,
                    start_new_session=True,
                    preexec_fn=None if self.prlimit else functools.partial(_set_rlimits, limits),
                )
            except OSError as e:
                return RunResult("error", None, f"could not start: {e}", 0.0, "", "")
        self._procs.add(proc)
        peak = _PeakProcs(proc.pid, self.uid if os.geteuid() == 0 else None)
        peak.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            self._kill(proc)
            peak.stop()
            self._procs.discard(proc)
        duration = time.monotonic() - start
        limit = cfg.output_limit_bytes
        stdout = tail(_read_tail(out_path, limit), limit)
        stderr = tail(_read_tail(err_path, limit), limit)
        code = proc.returncode
        if code is not None and code < 0:
            code = 128 - code
        status, reason = self._classify(code, timed_out, timeout, stderr, peak.peak)
        return RunResult(status, code if not timed_out else None, reason, duration, stdout, stderr)

    def _classify(
        self, code: int | None, timed_out: bool, timeout: float, stderr: str, peak: int
    ) -> tuple[str, str]:
        cfg = self.cfg
        if not timed_out and code == 0:
            return "ok", ""
        # bwrap and the forwarder are processes of the sandbox too: one of slack.
        if peak >= cfg.pids - 1:
            return "killed", f"pids: reached the limit of {cfg.pids} processes"
        if timed_out or code is None:
            return "timeout", f"wall time {timeout:g} s exceeded"
        if code == 128 + signal.SIGXCPU:
            return "killed", f"cpu: CPU-time limit reached ({signal_reason(code)})"
        if code == 128 + signal.SIGXFSZ:
            return "killed", f"disk: file size limit of {cfg.disk_mb} MiB ({signal_reason(code)})"
        if any(m in stderr[-4000:] for m in MEMORY_MARKERS):
            return (
                "killed",
                f"memory: allocation over {cfg.memory_mb} MiB refused ({signal_reason(code)})",
            )
        detail = last_line(stderr)
        return "error", f"{signal_reason(code)}" + (f": {detail}" if detail else "")

    def _command(
        self, cmd: list[str], env: dict[str, str] | None, work: Path, timeout: float
    ) -> tuple[list[str], dict[str, str]]:
        """argv (limits, then bwrap, then the forwarder, then cmd) and the agent's environment."""
        cfg = self.cfg
        root = os.geteuid() == 0
        run_env = agent_env(cfg, env, home=INSIDE_WORK if self.bwrap else str(work))
        # `python3` is this interpreter, its agent libraries importable (bwrap binds its prefix;
        # a bare process as root gets the folders above it opened, see `_open_closed_dirs`).
        run_env["PATH"] = f"{Path(sys.executable).parent}:{run_env['PATH']}"
        # Without a net namespace all sandboxes share the host loopback: let the forwarder pick.
        if self.bwrap:
            argv = launcher(cfg, cmd, cfg.gateway_port)
        else:  # the forwarder runs on the host (start), on a free port of the shared loopback
            argv = launcher(dataclasses.replace(cfg, gateway_socket=None), cmd, 0)
            if self._listener is not None:
                port = self._listener.getsockname()[1]
                run_env.setdefault("OPENAI_BASE_URL", f"http://127.0.0.1:{port}{cfg.gateway_path}")
        if root:
            # RLIMIT_NPROC does not bind root: the agent drops to the sandbox's own uid before
            # anything of it runs. bwrap runs privileged (no user namespace, so the system and
            # this Python are readable even under /root); a bare process gets a mount namespace
            # that opens the folders it needs (see `_open_closed_dirs`).
            drop = [f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"]
            argv = ["setpriv", *drop, "--no-new-privs", "--", *argv]
        if self.bwrap:
            argv = self._bwrap_argv(work) + argv
        elif root:
            argv = self._open_closed_dirs([*_python_dirs(), *self.ro_paths]) + argv
        return self._limits_argv(timeout) + argv, run_env

    def _open_closed_dirs(self, paths: list[str]) -> list[str]:
        """Process mode as root: a prefix that lets the sandbox uid reach `paths` (read-only).

        A Python (or venv) under a folder others may not enter, such as `/root` (0700), cannot
        be run by the sandbox's uid. Each such folder is covered, in a private mount namespace,
        by a skeleton (0755) holding only the needed paths, bound read-only; nothing of the
        host changes and the rest of the folder stays hidden. [] when no path needs it."""
        assert self.root is not None
        closed: dict[str, list[str]] = {}
        for path in dict.fromkeys(os.path.realpath(p) for p in paths):
            top = _first_closed_parent(path)
            if top is not None:
                closed.setdefault(top, []).append(path)
        if not closed:
            return []
        lines = ["set -e"]
        for n, (top, inner) in enumerate(sorted(closed.items())):
            skeleton = self.root / f"open.{n}"
            for path in inner:
                dest = skeleton / os.path.relpath(path, top)
                dest.mkdir(mode=0o755, parents=True, exist_ok=True)
                lines.append(f"mount --bind -- {shlex.quote(path)} {shlex.quote(str(dest))}")
                lines.append(f"mount -o remount,bind,ro -- {shlex.quote(str(dest))}")
            for d in [skeleton, *(p for p in skeleton.rglob("*") if p.is_dir())]:
                d.chmod(0o755)
            lines.append(f"mount --rbind -- {shlex.quote(str(skeleton))} {shlex.quote(top)}")
        lines.append('exec "$@"')
        script = "\n".join(lines)
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"]

    def _bwrap_argv(self, work: Path) -> list[str]:
        cfg = self.cfg
        argv = [self.bwrap or "bwrap"]
        if os.geteuid() == 0:
            argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
            argv += ["--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            argv += ["--unshare-all"]
        argv += ["--die-with-parent", "--hostname", "sandbox"]
        argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        binds = [*SYSTEM_DIRS, *_python_dirs(), *self.ro_paths]
        seen: set[str] = set()
        for path in binds:
            if path in seen or not os.path.lexists(path):
                continue
            seen.add(path)
            if os.path.islink(path) and path in SYSTEM_DIRS:
                argv += ["--symlink", os.readlink(path), path]  # merged /usr: /bin -> usr/bin
            else:
                argv += ["--ro-bind", path, path]
        argv += ["--bind", str(work), INSIDE_WORK, "--chdir", INSIDE_WORK]
        if cfg.gateway_socket is not None:
            argv += ["--ro-bind", str(FORWARDER_FILE), INSIDE_FORWARDER]
            argv += ["--ro-bind", cfg.gateway_socket, INSIDE_SOCKET]
        # privileged bwrap makes missing parents of mount points 0700 (root's); the sandbox uid
        # must traverse them, so create them 0755 first.
        dests = [argv[i + 2] for i, a in enumerate(argv) if a in ("--ro-bind", "--bind")]
        parents = sorted({str(p) for d in dests for p in PurePosixPath(d).parents} - {"/"})
        mkdirs = [x for p in parents for x in ("--perms", "0755", "--dir", p)]
        first_bind = argv.index("--ro-bind")
        return argv[:first_bind] + mkdirs + argv[first_bind:] + ["--"]

    def _rlimits(self, timeout: float) -> dict[str, int]:
        cfg = self.cfg
        nproc = cfg.pids
        if os.geteuid() != 0:  # RLIMIT_NPROC counts every process of our uid
            nproc += _count_procs(os.geteuid())
        cores = max(1, math.ceil(cfg.cpus))
        return {
            "data": cfg.memory_mb << 20,
            "nproc": nproc,
            "cpu": int(math.ceil(timeout * cores)) + 5,
            "fsize": cfg.disk_mb << 20,
            "core": 0,
        }

    def _limits_argv(self, timeout: float) -> list[str]:
        cores = max(1, math.ceil(self.cfg.cpus))
        # rotate, so that one-core sandboxes spread over the cores instead of sharing core 0
        mine = sorted(os.sched_getaffinity(0))
        first = next(_core_counter) % len(mine)
        allowed = sorted((mine[first:] + mine[:first])[:cores])
        argv = []
        if shutil.which("taskset"):
            argv = ["taskset", "-c", ",".join(map(str, allowed))]
        if self.prlimit:
            argv += (
                [self.prlimit]
                + [f"--{k}={v}:{v}" for k, v in self._rlimits(timeout).items()]
                + ["--"]
            )
        return argv

    def _kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL the process group (and, as root, every process of the sandbox uid) until gone."""
        for _ in range(50):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if os.geteuid() == 0:
                for pid in _pids_of_uid(self.uid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.1)
            if proc.returncode is not None and not (os.geteuid() == 0 and _pids_of_uid(self.uid)):
                return
        log.warning("sandbox: processes of uid %s survived 50 kill rounds", self.uid)

    def _work(self) -> Path:
        if self.workdir is None:
            raise SandboxError("sandbox is not started (use `with open_sandbox(cfg) as sb:`)")
        return self.workdir


class _PeakProcs:
    """Samples how many processes the sandbox has (its uid's, or its session's) until stopped."""

    def __init__(self, sid: int, uid: int | None) -> None:
        self.sid, self.uid, self.peak = sid, uid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            if self.uid is not None:
                n = len(_pids_of_uid(self.uid))
            else:
                n = sum(1 for _ in _pids_of_session(self.sid))
            self.peak = max(self.peak, n)


def _set_rlimits(limits: dict[str, int]) -> None:
    """preexec_fn fallback when the `prlimit` binary is missing (util-linux usually has it)."""
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (value, value))


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes owned by `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if entry.stat().st_uid == uid:
                    state = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state not in ("Z", "X"):
                        pids.append(int(entry.name))
    return pids


def _pids_of_session(sid: int):
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(entry.path, "stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                if int(fields[3]) == sid:  # state ppid pgrp session
                    yield int(entry.name)


def _count_procs(uid: int) -> int:
    return len(_pids_of_uid(uid))


def _python_dirs() -> list[str]:
    """Where this interpreter and its packages live, so `python3` works in the sandbox."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    dirs.add(str(Path(os.path.realpath(sys.executable)).parent.parent))
    return outside_system_dirs(sorted(dirs))


def _first_closed_parent(path: str) -> str | None:
    """The outermost folder above `path` that other users may not enter (no o+x), or None."""
    for parent in reversed(PurePosixPath(path).parents):
        if str(parent) != "/" and not os.stat(parent).st_mode & stat.S_IXOTH:
            return str(parent)
    return None


def _inside(path: Path, root: Path) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def _check_inside(path: Path, root: Path) -> None:
    if not _inside(path, root):
        raise ValueError(f"file path {path}: resolves outside the work dir")


def _read_tail(path: Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read()
