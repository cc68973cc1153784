"""The sandbox base image, built offline: `python -m sandbox.image build [tag=...] [force=true]`.

No container registry is reachable, so the image is made from scratch: `debootstrap
--variant=minbase` (Debian, from the mirror apt already uses) + `python3`, then the agent
libraries (`openai`, `openai-agents`) are installed into the root filesystem with pip (wheels
downloaded by the host's pip, installed offline by the image's own pip), and the tree is
`docker import`ed under a tag. A build takes about two minutes and is skipped when the tag already
exists, so it runs once per machine. Users may name any image of their own instead
(`SandboxConfig.image`); it needs `python3` when the sandbox is wired to a gateway, because the
forwarder (`sandbox/forwarder.py`) runs inside it.

Needs root, `debootstrap` and a running Docker engine (`scripts/test_services.sh` provides them).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway.config import parse_cli
from sandbox.base import DEFAULT_IMAGE

AGENT_PACKAGES = ["openai", "openai-agents"]


@dataclasses.dataclass
class ImageConfig:
    tag: str = DEFAULT_IMAGE
    """Docker tag of the image to build (skipped when it exists)."""
    force: bool = False
    """Rebuild even when the tag exists."""
    suite: str = "bookworm"
    """Debian suite for debootstrap."""
    mirror: str = ""
    """Debian mirror URL; empty = the first `deb.debian.org`-style URI in apt's own sources."""
    packages: list[str] = dataclasses.field(default_factory=lambda: list(AGENT_PACKAGES))
    """Python packages pip installs into the image."""


def image_exists(tag: str = DEFAULT_IMAGE) -> bool:
    """True when the Docker engine has an image named `tag`."""
    import docker  # the SDK; imported here so `--help` works without a daemon

    try:
        docker.from_env().images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def docker_unavailable(tag: str = DEFAULT_IMAGE) -> str:
    """'' when the Docker engine answers and has image `tag`; otherwise why not, with the fix."""
    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception as e:  # noqa: BLE001 - any failure to reach the engine reads the same
        return f"no Docker engine ({e}); run scripts/test_services.sh or start dockerd"
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return f"no sandbox image {tag}; run `python -m sandbox.image build`"
    return ""


def apt_mirror(sources: list[Path] | None = None) -> str:
    """The Debian mirror apt is configured with (deb822 `URIs:` or one-line `deb URL ...`)."""
    if sources is None:
        etc = Path("/etc/apt")
        sources = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*"))]
    for path in sources:
        if not path.is_file() or path.suffix not in (".list", ".sources", ""):
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            url = ""
            if words[:1] == ["URIs:"] and len(words) > 1:
                url = words[1]
            elif words[:1] == ["deb"] and len(words) > 2:
                url = next((w for w in words[1:] if "://" in w), "")
            if "debian" in url and "security" not in url:
                return url
    return "http://deb.debian.org/debian"


def build_image(cfg: ImageConfig) -> str:
    """Build `cfg.tag` (unless it exists and not `force`); returns the tag."""
    if not cfg.force and image_exists(cfg.tag):
        print(f"sandbox image {cfg.tag} exists; reusing it (force=true rebuilds)")
        return cfg.tag
    if os.geteuid() != 0:
        raise PermissionError("building the sandbox image needs root (debootstrap and chroot)")
    if shutil.which("debootstrap") is None:
        raise FileNotFoundError(
            "debootstrap not found: apt-get install debootstrap (scripts/test_services.sh does it)"
        )
    start = time.monotonic()
    mirror = cfg.mirror or apt_mirror()
    with tempfile.TemporaryDirectory(prefix="loongsage-image-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _step(f"debootstrap {cfg.suite} from {mirror}")
        _check(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-pip,ca-certificates",
                cfg.suite,
                str(rootfs),
                mirror,
            ]
        )
        pyver = subprocess.run(
            [
                "chroot",
                str(rootfs),
                "python3",
                "-c",
                "import sys; print('%d.%d' % sys.version_info[:2])",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        # The host's pip downloads (it knows this machine's indexes and caches); the image's own
        # pip installs offline, so nothing inside the chroot needs the network.
        wheels = rootfs / "tmp" / "wheels"
        _step(f"pip download {' '.join(cfg.packages)} for python {pyver}")
        _check(
            [sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels)]
            + ["--python-version", pyver, "--only-binary=:all:", *cfg.packages]
        )
        _step("pip install inside the image")
        _check(
            ["chroot", str(rootfs), "python3", "-m", "pip", "install", "-q", "--no-index"]
            + ["--no-cache-dir", "--break-system-packages", "--find-links", "/tmp/wheels"]
            + cfg.packages
        )
        shutil.rmtree(wheels)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for child in (rootfs / junk).glob("*"):
                if child.is_file():
                    child.unlink()
        _step(f"docker import as {cfg.tag}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imp = subprocess.run(
                ["docker", "import", "--change", "WORKDIR /work", "--change", 'CMD ["python3"]']
                + ["-", cfg.tag],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
            )
        finally:
            tar.stdout.close()
            tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import failed: {imp.stderr[-4000:]}")
    print(f"sandbox image {cfg.tag} built in {time.monotonic() - start:.0f} s")
    return cfg.tag


def _step(msg: str) -> None:
    print(f"[sandbox.image] {msg}", flush=True)


def _check(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("build", "exists"):
        raise SystemExit("usage: python -m sandbox.image build|exists [tag=...] [force=true]")
    cfg = parse_cli(ImageConfig, argv[1:])
    if argv[0] == "exists":
        raise SystemExit(0 if image_exists(cfg.tag) else 1)
    build_image(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
