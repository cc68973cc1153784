"""TransferMesh against a REAL SGLang server on this GPU machine (run by gpu_check_transfermesh.sh).

    python scripts/gpu_check_transfermesh.py URL MODEL_DIR ROUTE [ROUTE ...]

Runs in SGLang's own virtualenv with this repository on PYTHONPATH: the CUDA IPC route needs
SGLang's serializer in the sending process, as a trainer colocated with SGLang would. The
"trainer" here is this process holding the model's own weights on its GPU (HF names, as the
folder has them), with `model.norm.weight` shifted by a known amount per version so the server's
copy can be checked. Per route (`cuda_ipc`, `broadcast`, `disk`):

1. a request streams while the version is pushed: its tokens must carry the old version, then
   the new one, in one switch (SGLang's per-token `weight_versions` spans);
2. the server's `weight_version` and its `model.norm.weight` (`/get_weights_by_name`) must be the
   pushed ones; a greedy request afterwards carries the new version;
3. one row: bytes, seconds, GB/s, the stall the server saw (pause to continue).

Before any route, SGLang's session rule: a tensor update outside `/begin_weight_update` ...
`/end_weight_update` must be refused. `TRANSFER_BACKEND=gloo` makes the broadcast route use gloo
(GPU tensors through host memory): NCCL refuses two ranks on one GPU, so a one-GPU machine checks
the broadcast path that way, and a machine with a second GPU for this process checks NCCL.
"""

from __future__ import annotations

import asyncio
import glob
import os
import sys

import httpx
import torch
from safetensors.torch import load_file

from gateway.engines.base import EngineError, SamplingParams
from gateway.engines.sglang import SGLangEngine
from trainer.transfer import TransferConfig, TransferMesh

PROBE = "model.norm.weight"
PROMPT = [1, 9038, 2114, 314, 253, 1345, 30, 198]


def server_values(url: str, name: str, n: int = 16) -> list[float]:
    answer = httpx.post(
        url + "/get_weights_by_name", json={"name": name, "truncate_size": n}, timeout=60
    ).json()
    values = answer.get("parameter", answer) if isinstance(answer, dict) else answer
    return torch.tensor(values, dtype=torch.float32).flatten()[:n].tolist()


async def push_while_generating(
    server: SGLangEngine, mesh: TransferMesh, version: int
) -> tuple[list[int], object]:
    stream = server.stream(PROMPT, SamplingParams(max_tokens=2048, ignore_eos=True))
    versions = list((await anext(stream)).versions)
    report = await mesh.push(version)
    async for chunk in stream:
        versions += chunk.versions
    return versions, report


async def main(url: str, model_dir: str, routes: list[str]) -> int:
    server = await SGLangEngine(url).connect()
    base: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        base |= load_file(path, device="cuda")
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    print(f"weights: {len(base)} tensors, {nbytes / 1e9:.2f} GB on {torch.cuda.get_device_name()}")

    try:
        await server.update_weights_from_tensor(["eA=="], server.weight_version + 1)
        print("FAIL: a tensor update outside a weight-update session was accepted")
        return 1
    except (EngineError, ValueError) as exc:
        print(f"ok: tensor update outside a session refused ({exc})")

    backend = os.environ.get("TRANSFER_BACKEND", "")
    rows = [
        "| route | bytes | seconds | GB/s | stall (pause to continue) |",
        "|---|---:|---:|---:|---:|",
    ]
    failures = 0
    for route in routes:
        version = server.weight_version + 1
        new = dict(base)
        new[PROBE] = base[PROBE] + 0.125 * version  # exact in bf16 for norm-sized values
        cfg = TransferConfig(route=route, bucket_mb=512, broadcast_backend=backend)
        mesh = TransferMesh(new, [server], cfg)
        print(mesh.plan.describe())
        versions, report = await push_while_generating(server, mesh, version)
        await mesh.close()
        problems = []
        if report.failed:
            problems.append(f"push failed: {report.failed}")
        if server.weight_version != version:
            problems.append(f"server reports version {server.weight_version}")
        if version in versions:
            switch = versions.index(version)
            if versions[switch:] != [version] * (len(versions) - switch) or (
                len(set(versions[:switch])) > 1
            ):
                problems.append(f"versions do not switch once: {versions}")
        else:
            problems.append("no token carries the new version")
        want = new[PROBE].float().flatten()[:16].tolist()
        got = server_values(url, PROBE)
        if got != want:
            problems.append(f"{PROBE} on the server {got[:4]} != pushed {want[:4]}")
        after = await server.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))
        if after.output_versions != [version] * len(after.output_ids):
            problems.append(f"a request after the push carries {after.output_versions}")
        stats = report.routes[0] if report.routes else None
        seconds = stats.seconds if stats else float("nan")
        rows.append(
            f"| {route}{' (' + backend + ')' if route == 'broadcast' and backend else ''} | "
            f"{nbytes / 1e9:.2f} GB | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | "
            f"{report.stalls.get('engine0', float('nan')) * 1e3:.0f} ms |"
        )
        for problem in problems:
            print(f"FAIL {route}: {problem}")
        failures += bool(problems)
        print(f"{'ok' if not problems else 'FAIL'}: {route}")
    await server.close()
    print("\n".join(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__.split("\n\n")[1])
    raise SystemExit(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
