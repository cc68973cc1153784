"""gateway/machine.py: FLOPs and bytes counted from a model config (hand-checked), the roofline
built from them, the machine probes, and the CoreBoard of CPU lending."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gateway import machine
from gateway.machine import ModelShape

TOY = ModelShape(
    layers=1, hidden=2, intermediate=2, heads=1, kv_heads=1, head_dim=2, vocab=8, tied=True
)


def test_shape_of_the_tiny_model_and_its_counts(tiny_model_path):
    shape = ModelShape.from_config(AutoConfig.from_pretrained(tiny_model_path))
    assert shape == ModelShape(
        layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=49152,
        tied=True,
    )  # fmt: skip
    # Per layer: qkv 64x(64+2*32) + o 64x64 + gate_up 64x256 + down 128x64 = 36864, + 2 norms.
    assert shape.linears() == {
        "qkv": (64, 128), "o": (64, 64), "gate_up": (64, 256), "down": (128, 64)
    }  # fmt: skip
    assert shape.params == 2 * (36864 + 128) + 49152 * 64 + 64 == 3_219_776
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert shape.params == sum(p.numel() for p in model.parameters())  # tied: counted once
    assert shape.weight_bytes() == 4 * shape.params
    assert shape.weight_bytes(torch.bfloat16) == 2 * shape.params
    # 10 tokens, logits for 1, attending 1+2+...+10 = 55 positions in all:
    # 2 * (2 layers * (10 * 36864 + 2 * 4 heads * 16 * 55) + 1 * 64 * 49152)
    assert machine.causal_attended([10]) == 55
    assert shape.forward_flops(10, logits=1, attended=55) == 7_794_176
    assert shape.forward_flops(10, attended=55) == 7_794_176 + 2 * 9 * 64 * 49152
    assert shape.train_flops(10, 1, 55) == 3 * 7_794_176


def test_untied_head_is_counted_and_read(tiny_model_path):
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.tie_word_embeddings = False
    shape = ModelShape.from_config(config.to_dict())  # a plain dict works too
    model = AutoModelForCausalLM.from_config(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.weight_bytes() == 4 * (shape.params - 49152 * 64)  # embedding: gathered only


def test_generation_roofline_by_hand():
    # TOY: linears 2x6 + 2x2 + 2x4 + 2x2 = 28 per token; params 28 + 2*2 norms + 8*2 + 2 = 50.
    assert TOY.params == 50 and TOY.weight_bytes() == 200
    # Prefill of 2 tokens: 2*2*28 linear + 2*1*2*8 head + 2*2*(1*2*3) attention = 168 FLOPs.
    # Decode step (context 3): 2*28 + 32 + 24 = 112 FLOPs; reads 200 weight + 3*16 KV bytes.
    slow_memory = machine.generation_seconds(TOY, [2], 2, lambda m, k, n: 1.0, 1e-6)
    assert slow_memory == pytest.approx(0.2 + (0.2 + 0.048))  # bytes at 1000 B/s
    slow_math = machine.generation_seconds(TOY, [2], 2, lambda m, k, n: 1e-6, 1e3)
    assert slow_math == pytest.approx(0.168 + 0.112)  # FLOPs at 1000 FLOP/s

    def rates(m, k, n):  # the LM head (2 -> 8) at half the rate of everything else
        return 0.5e-6 if (k, n) == (2, 8) else 1e-6

    slow_head = machine.generation_seconds(TOY, [2], 2, rates, 1e3)
    assert slow_head == pytest.approx(0.168 + 0.112 + 2 * 0.032)
    # Two identical prompts prefilled once: the prefill's matmuls but for its 2 logits rows
    # (2*2*28 + 2*2*2*8 + 24 = 200 FLOPs), then two rows per decode step (2*112 FLOPs).
    shared = machine.generation_seconds(TOY, [2, 2], 2, lambda m, k, n: 1e-6, 1e3, distinct=[2])
    assert shared == pytest.approx(0.200 + 0.224)


def test_probes_measure_something_and_are_cached():
    assert machine.measure_matmul(8, 16, 32) > 0
    first = machine.matmul_gflops(8, 16, 32)
    assert first > 0 and machine.matmul_gflops(8, 16, 32) == first
    assert machine.measure_memcpy(nbytes=2**20) > 0
    assert machine.measure_read(nbytes=2**20) > 0
    assert "bf16 native" in machine.describe()
    assert isinstance(machine.native_bf16(), bool)


@pytest.mark.parametrize(
    ("native", "bf16_rate", "want"),
    [(False, 100.0, torch.float32), (True, 100.0, torch.bfloat16), (True, 5.0, torch.float32)],
)
def test_auto_dtype_needs_native_and_faster_bf16(monkeypatch, native, bf16_rate, want):
    monkeypatch.setattr(machine, "native_bf16", lambda device="cpu": native)
    monkeypatch.setattr(
        machine,
        "matmul_gflops",
        lambda m, k, n, dtype=torch.float32, device="cpu": (
            bf16_rate if dtype == torch.bfloat16 else 30.0
        ),
    )
    assert machine.auto_dtype() == want


def test_core_board_counts_the_idle_cores_of_the_others():
    board = machine.CoreBoard.create(4)
    try:
        engine1, engine2 = machine.CoreBoard(board.path, 1), machine.CoreBoard(board.path, 2)
        assert board.idle_cores() == 0  # nobody has marked: absent slots lend nothing
        engine1.mark(busy=False, cores=2)
        engine2.mark(busy=True, cores=1)
        assert board.idle_cores() == 2
        engine2.mark(busy=False, cores=1)
        board.mark(busy=False, cores=5)  # its own slot never counts for itself
        assert board.idle_cores() == 3 and engine1.idle_cores() == 6
        engine1.mark(busy=True, cores=2)
        assert board.idle_cores() == 1
        engine2.close()  # gone: lends nothing
        assert board.idle_cores() == 0
        engine1.close()
        with pytest.raises(ValueError, match="slot must be in"):
            machine.CoreBoard(board.path, 4)
    finally:
        board.close()
    assert not os.path.exists(board.path)


def test_huge_page_zeros_are_zeros_that_outlive_their_mapping():
    """`huge_page_zeros`: a writable zero tensor of the shape and dtype asked for, 2 MB-aligned
    when it spans huge pages; the mapping lives as long as any view of it."""
    big = machine.huge_page_zeros((3, machine.HUGE_PAGE // 4 + 5), torch.float32)
    assert big.shape == (3, machine.HUGE_PAGE // 4 + 5) and big.dtype == torch.float32
    assert big.is_contiguous() and not big.any()
    assert big.data_ptr() % machine.HUGE_PAGE == 0
    row = big[2]
    del big
    row.fill_(1.5)
    assert row.sum().item() == 1.5 * row.numel()
    small = machine.huge_page_zeros((4, 5), torch.bfloat16)
    assert small.shape == (4, 5) and small.dtype == torch.bfloat16 and not small.any()
