"""`docker` sandbox backend: a tmpfs work volume, a holder container, and one container per run.

`start` creates a tmpfs volume (size `disk_mb`) and a tiny "holder" container that keeps it
mounted (a tmpfs volume loses its content when nothing mounts it) and through which files go in
and out (`put_archive`/`get_archive` work on volume paths even with a read-only root). Each `run`
is a fresh container on the same volume with:

- `network_mode=none` (only a loopback), the gateway's Unix socket and `forwarder.py` bound
  read-only under `/opt/loongsage`, the forwarder listening on `127.0.0.1:gateway_port`;
- `ro_binds` (and a venv's base Python) bound read-only at their host paths; the folders above
  them are the image's, so one under the image's `/root` (0700) is not reachable by the agent's
  uid. An agent's packages belong in a derived image (`python -m sandbox.image build
  packages=[...]`); binds are for data and code that change between runs;
- memory (= memory+swap) `memory_mb`, CPU quota `cpus`, pids limit `pids`, read-only root,
  `/tmp` a small tmpfs, all capabilities dropped, `no-new-privileges`, tini as pid 1;
- uid 65534 (nobody), or the gateway socket's owner when the socket is not connectable by
  others (so the agent connects without any capability);
- a wall-time timeout (`wait(timeout)`, then kill); the OOM flag and the pids cgroup's
  `pids.events` tell `killed (memory)` and `killed (pids)` apart from a plain timeout.

Every container and the volume are labelled `loongsage.sandbox` and removed in `stop` (called
from `finally` and at interpreter exit), also when `start` failed half way. A controller killed
by SIGKILL leaves them behind: `docker rm -f $(docker ps -aq -f label=loongsage.sandbox)`.

What it does NOT give: the kernel is shared with the host (no gVisor/Kata) and there is no
user-namespace remapping (if the agent must run as the socket's owner and that is root, it is
root without capabilities, on a read-only root with only the socket and the forwarder bound
in); the default seccomp profile, not a tighter one; the work tmpfs lives in host RAM
(`disk_mb` per sandbox) and `/tmp` (16 MiB) and the logs count on the host; CPU is a quota, not
pinned cores; the gateway itself is reachable, so isolation *between* sessions rests on the
gateway's per-session keys.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import threading
import time
import uuid
from pathlib import PurePosixPath

from sandbox.base import (
    FORWARDER_FILE,
    INSIDE_FORWARDER,
    INSIDE_SOCKET,
    RunResult,
    SandboxConfig,
    SandboxError,
    agent_env,
    check_gateway_socket,
    last_line,
    launcher,
    log,
    ro_bind_paths,
    safe_relpath,
    signal_reason,
    tail,
)

LABEL = "loongsage.sandbox"
WORKDIR = "/work"
CGROUP_PIDS_EVENTS = (
    "/sys/fs/cgroup/pids/docker/{id}/pids.events",  # cgroup v1, cgroupfs driver
    "/sys/fs/cgroup/pids/system.slice/docker-{id}.scope/pids.events",  # v1, systemd driver
    "/sys/fs/cgroup/system.slice/docker-{id}.scope/pids.events",  # v2, systemd driver
    "/sys/fs/cgroup/docker/{id}/pids.events",  # v2, cgroupfs driver
)


class DockerSandbox:
    """Work volume + holder container; `run` starts one limited, network-less container."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.name = f"loongsage-{uuid.uuid4().hex[:12]}"
        self.isolation = (
            f"docker: network none, read-only root, memory {cfg.memory_mb} MiB, "
            f"cpus {cfg.cpus:g}, pids {cfg.pids}, caps dropped"
        )
        self.client = None
        self.volume = None
        self.holder = None
        self._containers: set = set()
        self.user = "65534:65534"
        self.ro_paths: list[str] = []  # cfg.ro_binds and their venvs' base Pythons (start)
        self._stop_lock = threading.Lock()

    @staticmethod
    def unavailable(cfg: SandboxConfig) -> str:
        """'' when the Docker engine answers and has `cfg.image`, else why not (see base.py)."""
        from sandbox.image import docker_unavailable

        why = docker_unavailable(cfg.image)
        return f"{why} (or use kind=local)" if why else ""

    # ---- lifecycle ----

    def start(self) -> None:
        import docker  # the SDK; imported here so the local backend works without it

        try:
            self.client = docker.from_env()
            self.client.ping()
        except docker.errors.DockerException as e:
            raise SandboxError(
                f"sandbox.kind=docker: no Docker engine ({e}); start dockerd "
                "(scripts/test_services.sh does) or use kind=local"
            ) from None
        try:
            self.client.images.get(self.cfg.image)
        except docker.errors.ImageNotFound:
            raise SandboxError(
                f"sandbox.image {self.cfg.image!r} not found: build it with "
                "`python -m sandbox.image build` or name an image you have"
            ) from None
        self.ro_paths = ro_bind_paths(self.cfg)
        sock = self.cfg.gateway_socket
        check_gateway_socket(sock, other_uid=False)
        if sock is not None:
            st = os.stat(sock)
            if st.st_mode & 0o002 == 0:  # not connectable by others: run as its owner
                self.user = f"{st.st_uid}:{st.st_gid}"
        try:
            self._create_volume_and_holder()
        except docker.errors.DockerException as e:
            raise SandboxError(f"docker: could not start the sandbox: {e}") from None

    def _create_volume_and_holder(self) -> None:
        assert self.client is not None
        uid, gid = self.user.split(":")
        self.volume = self.client.volumes.create(
            name=self.name,
            driver="local",
            driver_opts={
                "type": "tmpfs",
                "device": "tmpfs",
                "o": f"size={self.cfg.disk_mb}m,uid={uid},gid={gid},mode=0755",
            },
            labels={LABEL: "1"},
        )
        self.holder = self._create(["sleep", "infinity"], name=f"{self.name}-holder", holder=True)
        self.holder.start()

    def stop(self) -> None:
        # `finally` and atexit may both stop one sandbox, from two threads
        with self._stop_lock:
            self._stop()

    def _stop(self) -> None:
        for c in [*self._containers, self.holder]:
            if c is not None:
                try:
                    c.remove(force=True)
                except Exception as e:  # noqa: BLE001 - clean-up goes on; say what was left
                    if "already in progress" not in str(e) and "No such container" not in str(e):
                        log.warning("sandbox: could not remove container %s: %s", c.name, e)
        self._containers.clear()
        self.holder = None
        if self.volume is not None:
            # a container whose removal another call started still holds the volume a moment
            for attempt in range(50):
                try:
                    self.volume.remove(force=True)
                    break
                except Exception as e:  # noqa: BLE001 - clean-up goes on; say what was left
                    if "in use" in str(e) and attempt < 49:
                        time.sleep(0.2)
                        continue
                    log.warning("sandbox: could not remove volume %s: %s", self.volume.name, e)
                    break
            self.volume = None

    # ---- files ----

    def put_files(self, files: dict[str, str | bytes]) -> None:
        holder = self._holder()
        uid, gid = (int(x) for x in self.user.split(":"))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            dirs: set[str] = set()
            for rel, content in files.items():
                rel = safe_relpath(rel)
                for parent in reversed(PurePosixPath(rel).parents):
                    if str(parent) != "." and str(parent) not in dirs:
                        dirs.add(str(parent))
                        tar.addfile(_tarinfo(str(parent), uid, gid, tarfile.DIRTYPE, 0o755))
                data = content.encode() if isinstance(content, str) else content
                info = _tarinfo(rel, uid, gid, tarfile.REGTYPE, 0o644)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        if not holder.put_archive(WORKDIR, buf.getvalue()):
            raise SandboxError(f"put_files: docker refused the archive for {WORKDIR}")

    def get_files(self, paths: list[str]) -> dict[str, bytes]:
        """Regular files at `paths` (directories are expanded); missing ones are left out."""
        import docker

        holder = self._holder()
        out: dict[str, bytes] = {}
        for rel in paths:
            rel = safe_relpath(rel)
            try:
                stream, _ = holder.get_archive(f"{WORKDIR}/{rel}")
            except docker.errors.NotFound:
                continue
            data = b"".join(stream)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                # the archive's top entry is the basename of `rel`
                base = PurePosixPath(rel).parent
                for member in tar.getmembers():
                    if member.isreg():
                        f = tar.extractfile(member)
                        if f is not None:
                            out[str(base / member.name)] = f.read()
        return out

    # ---- runs ----

    def run(
        self, cmd: list[str], timeout_s: float | None = None, env: dict[str, str] | None = None
    ) -> RunResult:
        import docker
        import requests

        cfg = self.cfg
        timeout = cfg.timeout_s if timeout_s is None else timeout_s
        self._holder()
        argv = launcher(cfg, cmd, cfg.gateway_port)
        start = time.monotonic()
        container = None
        try:
            container = self._create(argv, env=agent_env(cfg, env, home=WORKDIR))
            container.start()
            timed_out = False
            try:
                code = container.wait(timeout=timeout)["StatusCode"]
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                timed_out, code = True, None
            pids_hit = (timed_out or code != 0) and self._pids_limit_hit(container)
            if timed_out:
                with contextlib.suppress(docker.errors.APIError):
                    container.kill()
            duration = time.monotonic() - start
            container.reload()
            oom = bool(container.attrs["State"].get("OOMKilled"))
            limit = cfg.output_limit_bytes
            stdout = tail(container.logs(stdout=True, stderr=False), limit)
            stderr = tail(container.logs(stdout=False, stderr=True), limit)
        except docker.errors.DockerException as e:
            return RunResult("error", None, f"docker: {e}", time.monotonic() - start, "", "")
        finally:
            if container is not None:
                with contextlib.suppress(Exception):
                    container.remove(force=True)
                self._containers.discard(container)
        status, reason = _classify(cfg, code, timed_out, timeout, oom, pids_hit, stderr)
        return RunResult(status, code, reason, duration, stdout, stderr)

    def _create(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        name: str | None = None,
        holder: bool = False,
    ):
        from docker.types import LogConfig, Mount

        cfg = self.cfg
        assert self.client is not None and self.volume is not None
        # no_copy: else docker copies the image's /work (and its root ownership) onto the volume
        mounts = [Mount(WORKDIR, self.volume.name, type="volume", no_copy=True)]
        if cfg.gateway_socket is not None and not holder:
            mounts.append(Mount(INSIDE_FORWARDER, str(FORWARDER_FILE), type="bind", read_only=True))
            mounts.append(Mount(INSIDE_SOCKET, cfg.gateway_socket, type="bind", read_only=True))
        if not holder:
            mounts += [Mount(p, p, type="bind", read_only=True) for p in self.ro_paths]
        mem = f"{16 if holder else cfg.memory_mb}m"
        # The holder only sleeps, but runc's Go init runs in its cgroup before the exec and may
        # start threads there: at pids=4 one start in a few hundred failed under load ("fork
        # rejected by pids controller", then docker's 500 "cannot start a stopped process").
        pids = 32 if holder else cfg.pids
        container = self.client.containers.create(
            cfg.image,
            argv,
            name=name,
            detach=True,
            user=self.user,
            working_dir=WORKDIR,
            environment=env or {},
            network_mode="none",
            hostname="sandbox",
            mounts=mounts,
            tmpfs={"/tmp": "size=16m,mode=1777"},
            read_only=True,
            mem_limit=mem,
            memswap_limit=mem,
            nano_cpus=int((0.1 if holder else cfg.cpus) * 1e9),
            pids_limit=pids,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            init=not holder,  # the holder's `sleep` as pid 1: a missing binary fails `start`
            labels={LABEL: self.name},
            log_config=LogConfig(
                type="json-file", config={"max-size": str(2 * cfg.output_limit_bytes)}
            ),
        )
        if not holder:
            self._containers.add(container)
            if self._stop_lock.locked() or self.holder is None:  # stopped meanwhile (atexit)
                with contextlib.suppress(Exception):
                    container.remove(force=True)
                raise SandboxError("sandbox was stopped")
        return container

    def _pids_limit_hit(self, container) -> bool:
        """Did a fork fail at the pids limit? The cgroup's `pids.events` counts exactly that."""
        for pattern in CGROUP_PIDS_EVENTS:
            with contextlib.suppress(OSError, ValueError):
                with open(pattern.format(id=container.id)) as f:
                    events = dict(line.split() for line in f if line.strip())
                return int(events.get("max", 0)) > 0
        # no cgroup file here (another cgroup layout, or a remote engine): ask for the count
        with contextlib.suppress(Exception):
            current = container.stats(stream=False)["pids_stats"]["current"]
            return current >= self.cfg.pids - 1
        return False

    def _holder(self):
        if self.holder is None:
            raise SandboxError("sandbox is not started (use `with open_sandbox(cfg) as sb:`)")
        return self.holder


def _classify(
    cfg: SandboxConfig,
    code: int | None,
    timed_out: bool,
    timeout: float,
    oom: bool,
    pids_hit: bool,
    stderr: str,
) -> tuple[str, str]:
    if not timed_out and code == 0:
        return "ok", ""  # even if a fork failed or a child was OOM-killed: the agent coped
    if oom:
        return "killed", f"memory: OOM-killed at the {cfg.memory_mb} MiB limit"
    if pids_hit:
        return "killed", f"pids: reached the limit of {cfg.pids} processes"
    if timed_out or code is None:
        return "timeout", f"wall time {timeout:g} s exceeded"
    detail = last_line(stderr)
    return "error", signal_reason(code) + (f": {detail}" if detail else "")


def _tarinfo(name: str, uid: int, gid: int, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, uid, gid, int(time.time())
    return info
