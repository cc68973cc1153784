"""Sandbox images, built offline: `python -m sandbox.image build [packages=[...]] [requirements=...]`.

**Base image** (`python -m sandbox.image build`, tag `loongsage-sandbox:latest`). No container
registry is reachable, so it is made from scratch: `debootstrap --variant=minbase` (Debian, from
the mirror apt already uses) + `python3`, then the agent libraries (`openai`, `openai-agents`)
are installed into the root filesystem with pip (wheels downloaded by the host's pip, installed
offline by the image's own pip), and the tree is `docker import`ed. About two minutes, skipped
when the tag exists, so it runs once per machine. Needs root, `debootstrap` and a running Docker
engine (`scripts/test_services.sh` provides them).

**Derived image** (bring your own agent): `build packages=[mini-swe-agent]` and/or
`requirements=path/to/requirements.txt` adds an agent's packages to the base image. The host's
pip downloads wheels for the image's Python, C library and machine (`pip download
--python-version X.Y --platform manylinux_2_N_ARCH ...`; the image has no compiler, so every
package needs a wheel); a container of the base image with no network installs them from that
folder (`pip install --no-index`) and is committed as the new image. Its tag is
`loongsage-sandbox:pkgs-<hash>` unless `tag=` names one; the hash covers the base image's id,
`packages` and the requirements file's text, and is kept in the image's `loongsage.packages`
label, so a build with the same package set is skipped and a changed set (or a rebuilt base)
builds anew. Needs a Docker engine and the package index (and, the first time, the base image).

Users may name any image of their own instead (`SandboxConfig.image`); it needs `python3` when
the sandbox is wired to a gateway, because the forwarder (`sandbox/forwarder.py`) runs inside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
PACKAGES_LABEL = "loongsage.packages"


@dataclasses.dataclass
class ImageConfig:
    packages: list[str] = dataclasses.field(default_factory=list)
    """Pip requirements added to `base` in a derived image, e.g. [mini-swe-agent]; none (and no `requirements`) = build the base image."""
    requirements: str = ""
    """A pip requirements file added to `base` in a derived image (with or instead of `packages`)."""
    tag: str = ""
    """Docker tag; '' = loongsage-sandbox:latest (base) or loongsage-sandbox:pkgs-<hash> (derived)."""
    base: str = DEFAULT_IMAGE
    """The image a derived one starts from; the base image is built first when this tag is missing."""
    force: bool = False
    """Rebuild even when the tag exists (with the same package set, for a derived image)."""
    suite: str = "bookworm"
    """Base image: Debian suite for debootstrap."""
    mirror: str = ""
    """Base image: Debian mirror URL; empty = the first `deb.debian.org`-style URI in apt's own sources."""


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
    """Build the base image, or a derived one when `cfg` names packages; returns its tag."""
    if cfg.packages or cfg.requirements:
        return build_derived(cfg)
    return build_base(cfg.tag or DEFAULT_IMAGE, cfg)


def build_base(tag: str, cfg: ImageConfig) -> str:
    """Build the base image `tag` (unless it exists and not `cfg.force`); returns the tag."""
    if not cfg.force and image_exists(tag):
        print(f"sandbox image {tag} exists; reusing it (force=true rebuilds)")
        return tag
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
        _step(f"pip download {' '.join(AGENT_PACKAGES)} for python {pyver}")
        _check(
            [sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels)]
            + ["--python-version", pyver, "--only-binary=:all:", *AGENT_PACKAGES]
        )
        _step("pip install inside the image")
        _check(
            ["chroot", str(rootfs), "python3", "-m", "pip", "install", "-q", "--no-index"]
            + ["--no-cache-dir", "--break-system-packages", "--find-links", "/tmp/wheels"]
            + AGENT_PACKAGES
        )
        shutil.rmtree(wheels)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for child in (rootfs / junk).glob("*"):
                if child.is_file():
                    child.unlink()
        _step(f"docker import as {tag}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imp = subprocess.run(
                ["docker", "import", "--change", "WORKDIR /work", "--change", 'CMD ["python3"]']
                + ["-", tag],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
            )
        finally:
            tar.stdout.close()
            tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise RuntimeError(f"docker import failed: {imp.stderr[-4000:]}")
    print(f"sandbox image {tag} built in {time.monotonic() - start:.0f} s")
    return tag


def packages_key(cfg: ImageConfig, base_id: str) -> str:
    """Content hash of a derived image: the base image's id, the packages, the requirements text."""
    requirements = Path(cfg.requirements).read_text() if cfg.requirements else ""
    return hashlib.sha256(json.dumps([base_id, cfg.packages, requirements]).encode()).hexdigest()


def build_derived(cfg: ImageConfig) -> str:
    """`cfg.base` plus `cfg.packages` / `cfg.requirements`, cached by content; returns the tag."""
    import docker

    if cfg.requirements and not Path(cfg.requirements).is_file():
        raise FileNotFoundError(f"requirements: {cfg.requirements!r} is not a file")
    if not image_exists(cfg.base):
        build_base(cfg.base, cfg)
    client = docker.from_env()
    key = packages_key(cfg, client.images.get(cfg.base).id)
    tag = cfg.tag or f"{DEFAULT_IMAGE.split(':')[0]}:pkgs-{key[:12]}"
    if not cfg.force and image_exists(tag):
        if client.images.get(tag).labels.get(PACKAGES_LABEL) == key:
            print(f"sandbox image {tag} has this package set; reusing it (force=true rebuilds)")
            return tag
    start = time.monotonic()
    target = image_python(cfg.base)
    with tempfile.TemporaryDirectory(prefix="loongsage-wheels-") as wheels:
        os.chmod(wheels, 0o755)
        reqs = []
        if cfg.requirements:
            shutil.copy(cfg.requirements, Path(wheels, "requirements.txt"))
            reqs = ["-r", "requirements.txt"]
        _step(f"pip download {' '.join(cfg.packages + reqs)} for {target['summary']}")
        _check(
            [sys.executable, "-m", "pip", "download", "-q", "-d", wheels, "--only-binary=:all:"]
            + ["--python-version", target["python"]]
            + [f"--platform={p}" for p in pip_platforms(target)]
            + [*cfg.packages, *reqs],
            cwd=wheels,
            hint="the image has no compiler: every package needs a wheel for its Python",
        )
        _step(f"pip install in a container of {cfg.base} (no network)")
        name = f"loongsage-build-{key[:12]}"
        pip = ["python3", "-m", "pip", "install", "-q", "--no-index", "--no-cache-dir"]
        pip += ["--break-system-packages", "--find-links", "/wheels", *cfg.packages, *reqs]
        try:
            _check(
                ["docker", "run", "--name", name, "--network", "none", "--user", "0:0"]
                + ["-v", f"{wheels}:/wheels:ro", "-w", "/wheels", cfg.base, *pip]
            )
            _step(f"docker commit as {tag}")
            changes = ['CMD ["python3"]', "WORKDIR /work", f"LABEL {PACKAGES_LABEL}={key}"]
            _check(["docker", "commit", *(a for c in changes for a in ("--change", c)), name, tag])
        finally:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    print(f"sandbox image {tag} built in {time.monotonic() - start:.0f} s")
    return tag


def image_python(image: str) -> dict[str, str]:
    """The Python version, C library and machine of `image` (asked of one throwaway container)."""
    probe = (
        "import json, platform, sys; lib, ver = platform.libc_ver(); print(json.dumps({"
        "'python': '%d.%d' % sys.version_info[:2], 'libc': lib, 'libc_version': ver, "
        "'machine': platform.machine()}))"
    )
    out = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", image, "python3", "-c", probe],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"image {image}: no working python3 ({out.stderr[-2000:]})")
    info = json.loads(out.stdout)
    info["summary"] = (
        f"python {info['python']}, {info['libc']} {info['libc_version']}, {info['machine']}"
    )
    return info


def pip_platforms(target: dict[str, str]) -> list[str]:
    """pip `--platform` tags of the wheels that run in the image: every manylinux up to its glibc.

    pip does not widen `--platform manylinux_2_36_x86_64` to older manylinux tags by itself.
    [] (the host's own tags) when the image's C library is not glibc."""
    if target["libc"] != "glibc":
        return []
    major, minor = (int(x) for x in target["libc_version"].split(".")[:2])
    arch = target["machine"]
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for m, name in legacy.items() if m <= minor]


def _step(msg: str) -> None:
    print(f"[sandbox.image] {msg}", flush=True)


def _check(cmd: list[str], cwd: str | None = None, hint: str = "") -> None:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    if proc.returncode != 0:
        why = f"; {hint}" if hint else ""
        raise RuntimeError(
            f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}{why}):\n{proc.stdout[-4000:]}"
        )


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("build", "exists"):
        raise SystemExit(
            "usage: python -m sandbox.image build|exists [packages=[...]] [requirements=FILE] "
            "[tag=...] [force=true]   (--help lists every key)"
        )
    cfg = parse_cli(ImageConfig, argv[1:])
    if argv[0] == "exists":
        raise SystemExit(0 if image_exists(cfg.tag or DEFAULT_IMAGE) else 1)
    print(build_image(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
