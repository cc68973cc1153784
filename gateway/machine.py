"""What this machine can do, measured: matmul GFLOP/s, memcpy GB/s, native bf16; and model FLOPs.

Benchmarks print every component against these numbers, measured in the same run (a roofline),
the trainer's `dtype: auto` asks `auto_dtype`, and MFU divides counted FLOPs by a measured peak.

- Probes are quick (a fraction of a second each), keep the best of a few repeats (a rate is a
  capability: load from other processes only ever slows it down) and are cached per process.
- `matmul_gflops(m, k, n)` times `x[m, k] @ w[n, k].T` (a linear layer) with the fastest kernel
  torch has here: `F.linear` (MKL on x86) and, on CPUs, oneDNN's linear. The same weight is
  reused, so it is cache-hot: at small m a matmul is bounded by memory instead.
- Memory, with buffers well beyond the last-level cache: `memcpy_gbps` is bytes copied per
  second (what a transfer that runs at memcpy speed shows), `read_gbps` bytes read per second
  by a reduction, `amax` (one compare an element: `sum`'s cascade summation reads ~15% slower
  on a 2-core Zen 4 EPYC, below what MKL's split GEMV reaches there, so it is no roof). A
  decode step at batch 1 only reads its weights, so the roofline's memory term uses the read
  rate, measured on CPU over huge pages as the local engine keeps its weights
  (`huge_page_zeros`; on a 2-core Zen 4 EPYC ~1.4x the rate over 4 KB pages); a copy moves
  each byte twice (read, then write), so memcpy's rate would understate the roof (here by
  ~2x).
- `native_bf16` is what the hardware says (CUDA; AVX512-BF16 or AMX on x86), not a timing:
  on CPUs without it (AVX2-only laptops and VMs) bf16 matmuls are emulated and 6-15x slower
  than fp32. `auto_dtype` picks bf16 only where it is native AND measured faster.

`CoreBoard`: CPU lending between the processes of one run on one machine. Each process holds
its own cores (a Ray actor's CPUs, as many torch threads); each marks itself busy or idle in a
few shared bytes, and computes with the cores of the idle others too, re-reading the board
between layers (the trainer) or decode steps (the engine).

FLOPs (`ModelShape`) count 2 per multiply-add of the matmuls: the linear layers (with q/k/v and
gate/up fused, as a fast implementation runs them), the LM head on the positions whose logits
are computed, and attention's QK^T and PV. Norms, activations, RoPE and softmax are left out
(well under 1% of the total for these models).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import mmap
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PROBE_SECONDS = 0.25
"""Wall time of one probe (split over 3 repeats)."""
MEMCPY_BYTES = 256 * 2**20
"""Buffer size of the memcpy probe: far beyond any last-level cache."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its FLOPs and weight bytes depend on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    """The LM head is the input embedding (counted once in `params`)."""

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From an HF config object or its dict (Llama-style field names)."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        return cls(
            layers=get("num_hidden_layers"),
            hidden=get("hidden_size"),
            intermediate=get("intermediate_size"),
            heads=heads,
            kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or get("hidden_size") // heads,
            vocab=get("vocab_size"),
            tied=bool(get("tie_word_embeddings", False)),
        )

    def linears(self) -> dict[str, tuple[int, int]]:
        """Per layer: name -> (in, out) features, q/k/v and gate/up fused."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "qkv": (self.hidden, q + 2 * kv),
            "o": (q, self.hidden),
            "gate_up": (self.hidden, 2 * self.intermediate),
            "down": (self.intermediate, self.hidden),
        }

    @property
    def params(self) -> int:
        """Parameters (tied embeddings once)."""
        per_layer = sum(i * o for i, o in self.linears().values()) + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + embeddings + self.hidden

    def weight_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one forward reads (every weight but the input embedding table, which is only
        gathered from; with tied embeddings the LM head reads it all)."""
        read = self.params - (0 if self.tied else self.vocab * self.hidden)
        return read * dtype.itemsize

    def forward_flops(self, tokens: int, logits: int | None = None, attended: int = 0) -> int:
        """FLOPs of a forward over `tokens` tokens, `logits` of them through the LM head (default
        all), where `attended` sums, over the tokens, the positions each one attends to."""
        logits = tokens if logits is None else logits
        linear = sum(i * o for i, o in self.linears().values())
        attention = 2 * self.heads * self.head_dim * attended  # QK^T and PV
        return 2 * (self.layers * (tokens * linear + attention) + logits * self.hidden * self.vocab)

    def train_flops(
        self, tokens: int, logits: int | None = None, attended: int = 0, frozen: bool = False
    ) -> int:
        """Forward + backward: twice the forward's matmuls (the gradients of their inputs and
        of their weights); once when the weights are `frozen` (LoRA), except attention's."""
        forward = self.forward_flops(tokens, logits, attended)
        if not frozen:
            return 3 * forward
        return 2 * forward + 4 * self.layers * self.heads * self.head_dim * attended


def causal_attended(lengths: Sequence[int]) -> int:
    """`attended` for causal forwards over whole sequences of these lengths."""
    return sum(n * (n + 1) // 2 for n in lengths)


def generation_seconds(
    shape: ModelShape,
    prompts: Sequence[int],
    new_tokens: int,
    matmul_gflops: Callable[[int, int, int], float],
    read_gbps: float,
    dtype: torch.dtype = torch.float32,
    distinct: Sequence[int] | None = None,
) -> float:
    """Roofline: the least time to prefill `prompts` (their lengths) and then decode them
    together until each has `new_tokens` new tokens, at these rates.

    Prefill: its matmuls (real tokens only: `distinct` gives the tokens each distinct prompt
    adds when identical prompts and shared prefixes are computed once; logits of each prompt's
    last position) at the rates of their shapes, or one read
    of the weights if slower. Each decode step: the larger of its matmuls at the batch's
    shapes and one read of the weights plus the KV cache."""
    rows = len(prompts)
    distinct = prompts if distinct is None else distinct

    def matmuls(m: int, logits: int, attended: int) -> float:
        seconds = sum(
            shape.layers * 2 * m * i * o / (matmul_gflops(m, i, o) * 1e9)
            for i, o in shape.linears().values()
        )
        seconds += (
            2
            * logits
            * shape.hidden
            * shape.vocab
            / (matmul_gflops(logits, shape.hidden, shape.vocab) * 1e9)
        )
        attention = shape.forward_flops(0, 0, attended)
        return seconds + attention / (matmul_gflops(m, shape.hidden, shape.hidden) * 1e9)

    weights = shape.weight_bytes(dtype) / (read_gbps * 1e9)
    total = max(matmuls(sum(distinct), rows, causal_attended(distinct)), weights)
    kv_bytes_per_position = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype.itemsize
    for step in range(1, new_tokens):
        context = [n + step for n in prompts]
        kv = sum(context) * kv_bytes_per_position / (read_gbps * 1e9)
        total += max(matmuls(rows, rows, sum(context)), weights + kv)
    return total


def matmul_gflops(
    m: int, k: int, n: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """Measured GFLOP/s of a linear layer `[m, k] x [n, k]^T` (cached per process)."""
    return _cached_matmul(m, k, n, dtype, str(device))


def measure_matmul(
    m: int, k: int, n: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """`matmul_gflops` measured now (benchmarks re-measure between runs and keep the best)."""
    device = str(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    best = 0.0
    with torch.inference_mode():
        for prepare, kernel in _linear_kernels(device, m):
            try:
                weight = prepare(w)
                seconds = _best_seconds(lambda f=kernel, w=weight: f(x, w), device)
            except RuntimeError:  # a kernel without this dtype here
                continue
            best = max(best, 2 * m * k * n / seconds / 1e9)
    return best


def memcpy_gbps(device: str = "cpu", nbytes: int = MEMCPY_BYTES) -> float:
    """Measured bytes copied per second (GB/s) between two large buffers (cached)."""
    return _cached_memcpy(str(device), nbytes)


def measure_memcpy(device: str = "cpu", nbytes: int = MEMCPY_BYTES) -> float:
    """`memcpy_gbps` measured now."""
    device = str(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return nbytes / _best_seconds(lambda: dst.copy_(src), device) / 1e9


_cached_matmul = functools.cache(measure_matmul)
_cached_memcpy = functools.cache(measure_memcpy)


def read_gbps(device: str = "cpu", nbytes: int = MEMCPY_BYTES) -> float:
    """Measured bytes read per second (GB/s) from a large buffer (cached)."""
    return _cached_read(str(device), nbytes)


def measure_read(device: str = "cpu", nbytes: int = MEMCPY_BYTES) -> float:
    """`read_gbps` measured now (on CPU over huge pages, as the local engine's weights are)."""
    device = str(device)
    if device == "cpu":  # written: untouched pages all map the kernel's one zero page
        src = huge_page_zeros((nbytes // 4,), torch.float32).fill_(1.0)
    else:
        src = torch.ones(nbytes // 4, device=device)
    return nbytes / _best_seconds(src.amax, device) / 1e9


_cached_read = functools.cache(measure_read)

HUGE_PAGE = 2 * 2**20


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on memory the kernel backs with 2 MB pages where it can (Linux
    transparent huge pages, `madvise` mode included: an anonymous private mapping, aligned and
    advised MADV_HUGEPAGE before first touch); torch's allocator uses 4 KB pages unless
    THP_MEM_ALLOC_ENABLE was set before its first allocation. A stream over 4 KB pages misses
    the TLB every page: measured on a 2-core Zen 4 EPYC, the local engine's one-row matmuls
    over its weights read 1.45x faster from huge pages (50 GB/s where the same loop over 4 KB
    pages read 34, and a 256 MB `amax` 44). Small tensors and other systems: `torch.zeros`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds `buf` while any view lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


def native_bf16(device: str = "cpu") -> bool:
    """Whether bf16 matmuls run in hardware here (not emulated)."""
    device = str(device)
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def auto_dtype(device: str = "cpu", shape: tuple[int, int, int] = (1024, 576, 1536)) -> torch.dtype:
    """bf16 where the hardware has it and a `shape` matmul measures faster; fp32 otherwise."""
    if not native_bf16(device):
        return torch.float32
    faster = matmul_gflops(*shape, torch.bfloat16, device) > matmul_gflops(*shape, device=device)
    return torch.bfloat16 if faster else torch.float32


def describe(device: str = "cpu") -> str:
    """One line naming the hardware, for benchmark and run headers."""
    device = str(device)
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(device)}, bf16 native: {native_bf16(device)}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"{name}, {torch.get_num_threads()} torch threads, {capability}, "
        f"bf16 native: {'yes' if native_bf16(device) else 'no'}"
    )


class CoreBoard:
    """Which processes of a run on one machine are computing, in two shared bytes per slot
    (state, cores held), so that one can borrow the cores the idle others hold. `create` makes
    the board (its creator removes it at `close`); each process opens it by path with a slot of
    its own (0: the trainer). A slot never marked is absent and lends nothing."""

    ABSENT, IDLE, BUSY = 0, 1, 2

    def __init__(self, path: str, slot: int) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        if not 0 <= slot < len(self._map) // 2:
            raise ValueError(f"slot must be in [0, {len(self._map) // 2}), got {slot}")
        self.path, self.slot = path, slot
        self._owner = False

    @classmethod
    def create(cls, slots: int) -> CoreBoard:
        """A new board of `slots` slots in shared memory (removed by `close`), opened at 0."""
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="loongsage-cores-", dir=shm)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(2 * slots))
        board = cls(path, 0)
        board._owner = True
        return board

    def mark(self, busy: bool, cores: int) -> None:
        """This slot is computing (`busy`) or not, holding `cores` cores (1-255)."""
        at = 2 * self.slot
        state = self.BUSY if busy else self.IDLE
        if self._map[at] != state or self._map[at + 1] != cores:
            self._map[at + 1] = cores
            self._map[at] = state

    def idle_cores(self) -> int:
        """Cores held by the other slots that are idle now."""
        m, own = self._map, 2 * self.slot
        return sum(m[i + 1] for i in range(0, len(m), 2) if i != own and m[i] == self.IDLE)

    def close(self) -> None:
        """Leave the board (this slot lends nothing from now on); its creator removes it."""
        self._map[2 * self.slot] = self.ABSENT
        self._map.close()
        if self._owner:
            os.unlink(self.path)


def _linear_kernels(device: str, rows: int) -> list[tuple[Callable, Callable]]:
    """(prepare the weight, multiply) pairs: torch's linear; on CPU for one row `gemv`, and
    oneDNN's on the plain weight and on one prepacked for `rows` rows (the local engine's
    kernels)."""
    kernels: list[tuple[Callable, Callable]] = [(_same, F.linear)]
    if device == "cpu" and rows == 1:
        kernels.append((_same, gemv))
    if device == "cpu" and torch.backends.mkldnn.is_available():
        prepack = functools.partial(onednn_prepack, rows=rows)
        kernels += [(_same, onednn_linear), (prepack, onednn_linear)]
    return kernels


def _same(w: torch.Tensor) -> torch.Tensor:
    return w


def onednn_prepack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """An [out, in] weight copied into oneDNN's blocked layout for inputs of about `rows` rows
    (an opaque tensor for `onednn_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ residual) by oneDNN, for a plain or `onednn_prepack`ed [out, in] weight."""
    linear = torch.ops.mkldnn._linear_pointwise
    if residual is None:
        return linear(x, weight, None, "none", [], "")
    return linear.binary(x, residual, weight, None, "add")


def gemv(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ residual, updated in place) for one row of x and an [out, in] weight
    with contiguous rows: the compiled kernel (`cpu_kernels`) where it built and takes the
    dtype, else `split_gemv` in fp32 and torch's linear otherwise."""
    kernels = cpu_kernels() if x.device.type == "cpu" else None
    if kernels is not None and x.dtype in (torch.float32, torch.bfloat16):
        return kernels.gemv(x.contiguous(), weight, residual)
    threads = torch.get_num_threads()
    if x.device.type == "cpu" and x.dtype == torch.float32 and threads > 1:
        out = split_gemv(x, weight, threads)
    else:
        out = F.linear(x, weight)
    return out if residual is None else residual.add_(out)


KERNELS_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")


@functools.cache
def cpu_kernels() -> Any:
    """The local engine's kernels (`cpu_kernels.cpp`: `gemv`, `layer_input`,
    `decode_attention`), compiled for this CPU on first use (~25 s on 2 cores; torch caches the
    build under TORCH_EXTENSIONS_DIR, `make setup` does it once), `gemv` checked against
    torch's linear; None, with a warning saying why, where they cannot be built (no C++
    compiler or OpenMP, e.g. macOS's clang) or are wrong: callers then run torch's ops.
    `ATEN_CPU_CAPABILITY=avx2` (or `default`) builds them without AVX-512 (and AVX2), as torch's
    kernels run then. Measured on a 2-core Zen 4 EPYC: MKL's GEMV runs on one thread, and its batched GEMM split over the threads
    (`split_gemv`) reads the layers' weights at ~27 GB/s where the cores read the same weights
    at ~40 (a sum over them); `gemv` reads them at the sum's rate (1.5x `split_gemv` in fp32,
    ~2.5x torch's bf16 GEMV). `decode_attention` does a decode step's RoPE, cache write and
    attention in one call a layer (the attention alone in 0.65x the time of torch's baddbmm,
    softmax and bmm at 32 rows)."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-march=native", "-fopenmp"]
    # Restricted as torch's own kernels are (ATEN_CPU_CAPABILITY), e.g. to measure an AVX2 CPU.
    flags += {"avx2": ["-mno-avx512f"], "default": ["-mno-avx2", "-mno-avx512f"]}.get(
        os.environ.get("ATEN_CPU_CAPABILITY", "").lower(), []
    )
    build = [
        platform.machine(),
        _cpu_flags(),
        torch.__version__,
        *flags,
        KERNELS_SOURCE.read_text(),
    ]
    name = "loongsage_kernels_" + hashlib.sha1("\n".join(build).encode()).hexdigest()[:12]
    try:
        module = cpp_extension.load(
            name, [str(KERNELS_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"]
        )
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
            x, w, r = torch.randn(1, 67), torch.randn(9, 67), torch.randn(1, 9)
            x, w, r = x.to(dtype), w.to(dtype), r.to(dtype)
            want = (x.float() @ w.float().T + r.float()).to(dtype).float()
            got = module.gemv(x, w, r.clone()).float()
            if not torch.allclose(got, want, atol=tol, rtol=tol):
                raise RuntimeError(f"{dtype} result off by {(got - want).abs().max():.3g}")
    except Exception as exc:  # noqa: BLE001 - any failure means: use the fallback
        log.warning("the engine's CPU kernels are unavailable (%s); using torch's ops", exc)
        return None
    return module


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for), where the OS says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor()


def split_gemv(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x @ weight.T for one row of x and a contiguous [out, in] weight, as one batched matmul
    of `parts` blocks of its rows (`gemv` without its kernel): MKL runs an fp32 GEMV on one
    thread, its batched GEMM a block per thread (batch-1 decoding 1.4x faster on a 2-core
    Zen 4 EPYC than one thread)."""
    n_out, n_in = weight.shape
    if not weight.is_contiguous() or n_out % parts:
        return F.linear(x, weight)
    blocks = weight.view(parts, n_out // parts, n_in).transpose(1, 2)
    return torch.bmm(x.expand(parts, 1, n_in), blocks).view(1, n_out)


def _best_seconds(fn: Callable[[], object], device: str, repeats: int = 3) -> float:
    """Fastest mean time of `fn` over `repeats` windows of PROBE_SECONDS / repeats each."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= PROBE_SECONDS / repeats:
                break
        best = min(best, elapsed / calls)
    return best
