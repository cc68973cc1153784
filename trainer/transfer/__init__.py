"""TransferMesh: after every optimizer step, every engine gets the new weights over its fastest
route, and switches to them all at once or not at all.

    trainer process (WeightSource: HF names)          engines (receivers)
      hf_specs -> buckets -> pack k+1 | send k  ---->  in_process  same process: engine copies the tensors
                                                       cuda_ipc    same GPU node: SGLang maps the buckets
                                                       shm         same host, CPU: weights live in /dev/shm, N reads
                                                       broadcast   gloo (CPU) / NCCL (GPU) group, one broadcast
                                                       disk        safetensors in a shared folder: anywhere

`TransferMesh(source, engines, cfg, mode)` plans once: every engine is a *receiver* that says
where it is (`Placement`: host, Ray node, process, device, the routes it accepts, the API it
speaks) and the planner gives it the first route, in the order above, that it accepts and that
reaches it from the trainer; `mesh.plan.describe()` prints who gets what and why (the main job
prints it at start; `transfer.route` forces one). `await mesh.push(version)` then, route by
route:

- describes the weights as HF-named `TensorSpec`s and cuts them into buckets (`bucket_mb`,
  default 512 MiB, SGLang's flattened-bucket layout), packing bucket k+1 while bucket k is in
  flight where a route has both halves (`transfer.pipeline`);
- runs the sending half where the weights live (`Sender`: this process, or the train backend's
  Ray actor, so the bytes never pass through the controller) and the receiving half next to
  each engine (`Receiver`: this process, an engine's Ray actor, or an SGLang server's HTTP API);
- makes every receiver apply a whole version or nothing: ours stage every bucket, then hand them
  to `Engine.update_weights` (an atomic swap between two decoding steps); SGLang servers load
  inside a paused weight-update session (`trainer/transfer/sglang.py`);
- never fails the push for one receiver: a receiver that fails or times out (`timeout_s`) keeps
  serving its old version, is reported (`PushReport.failed`, a warning, `mesh.status()`), gets
  one more try in the same push if it is still healthy, and the whole version at the next push.
  The gateway's router takes an engine behind the newest version out of its rotation, and every
  token an engine samples carries that engine's real version, so staleness is counted by it.

What generation does meanwhile is `rollout.partial_rollout`: `continue` keeps generating while
the buckets travel, then swaps between two steps (later tokens carry the new version);
`abort_resubmit` retracts running requests around the swap so they are recomputed. The stall
each engine sees (swap, or pause to resume) is in the `PushReport` and in metrics.jsonl
(`weights/stall_s/<engine>`), with bytes, seconds and GB/s per route (`weights/<route>/...`).

The HF-name view: routes read the trainer's weights through a `WeightSource`
(`trainer/transfer/endpoints.py`) whose names and shapes are exactly those of the model's HF
folder, so any engine loads them as a checkpoint. The torch backend is HF-named already
(`StateDictSource` over its `state_dict()`, tied weights once). A sharded trainer (Megatron)
implements the two methods on the process that sends, gathering and converting on demand:

    hf_specs() -> list[TensorSpec]                # HF name, shape, dtype of every tensor, in order
    hf_tensors(names) -> Iterator[(name, tensor)] # full HF tensors for these names, one at a time

and offers it as `backend.weight_source()`; every route then streams it bucket by bucket (peak
extra memory: one bucket plus one tensor), and `TransferMesh` needs nothing else from it. The
megatron backend does so (trainer/backends/megatron): its ranks are Ray actors
(`trainer.cluster.RankGroup`), so a route's sending half runs on rank 0 and announces the
`hf_tensors` calls it will make (`Sender.run(..., reads=)`); the other ranks make the same calls
alongside, since gathering a tensor-parallel or pipeline-parallel parameter is collective, and
rank 0 makes all of them even when the route fails half way. A source may say where its tensors
are with a `device` attribute (None: CPU), which the planner then reads instead of gathering.
"""

from trainer.transfer.buckets import Bucket, TensorSpec, make_buckets
from trainer.transfer.endpoints import (
    Placement,
    Receiver,
    Sender,
    StateDictSource,
    WeightSource,
    weight_source,
)
from trainer.transfer.mesh import (
    PARTIAL_ROLLOUT_MODES,
    ROUTES,
    Delivery,
    Plan,
    Push,
    PushReport,
    RouteStats,
    TransferConfig,
    TransferMesh,
    WeightRoute,
    apply_weights,
)

__all__ = [
    "PARTIAL_ROLLOUT_MODES",
    "ROUTES",
    "Bucket",
    "Delivery",
    "Placement",
    "Plan",
    "Push",
    "PushReport",
    "Receiver",
    "RouteStats",
    "Sender",
    "StateDictSource",
    "TensorSpec",
    "TransferConfig",
    "TransferMesh",
    "WeightRoute",
    "WeightSource",
    "apply_weights",
    "make_buckets",
    "weight_source",
]
