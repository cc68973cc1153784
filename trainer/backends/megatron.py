"""The megatron-core train backend (GPU, tensor/pipeline parallel): registered as
`train.kind=megatron`, not built yet; until it is, choosing it says what it needs."""

from __future__ import annotations

from typing import Any


class MegatronBackend:
    def __init__(self, cfg: Any) -> None:
        raise ValueError(
            "train.kind=megatron needs the megatron extra and a GPU "
            "(pip install -e '.[megatron]' on a CUDA machine); on CPU use train.kind=torch"
        )
