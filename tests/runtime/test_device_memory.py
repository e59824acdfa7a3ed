"""`runtime.device_memory`: the allocator cap's arithmetic and checks, with the CUDA calls replaced."""
from __future__ import annotations

import pytest
import torch

from runtime.device_memory import cap_device_memory, capped_free_bytes, memory_stats

GIB = 2**30


class FakeCuda:
    """Stands in for the torch.cuda calls the module makes: a 24 GiB card at index 0 (current device)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, free: int = 10 * GIB, reserved: int = 3 * GIB) -> None:
        self.fractions: list[tuple[float, int]] = []
        props = type("Props", (), {"total_memory": 24 * GIB})()
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda fraction, index: self.fractions.append((fraction, index)))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 24 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: reserved - GIB)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: reserved + 2 * GIB)
        self.fraction = 1.0
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: self.fraction)


def test_cap_sets_the_fraction_of_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    assert cap_device_memory("cuda", 6 * GIB) == 0.25
    assert cap_device_memory(torch.device("cuda", 0), 24 * GIB) == 1.0
    assert cuda.fractions == [(0.25, 0), (1.0, 0)]
    assert cap_device_memory("cuda", None) is None
    assert cuda.fractions == [(0.25, 0), (1.0, 0)]  # no cap: nothing set


def test_cap_refuses_what_the_device_cannot_give(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch)
    with pytest.raises(ValueError, match=r"exceeds cuda:0's memory \(25769803776 bytes\)"):
        cap_device_memory("cuda:0", 24 * GIB + 1)
    with pytest.raises(ValueError, match="must be >= 1 byte, got 0"):
        cap_device_memory("cuda", 0)
    with pytest.raises(ValueError, match="needs a CUDA device, got 'cpu'"):
        cap_device_memory("cpu", GIB)
    assert cuda.fractions == []
    assert cap_device_memory("cpu", None) is None  # no cap asked: any device


def test_free_bytes_under_a_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch, free=10 * GIB, reserved=3 * GIB)
    device = torch.device("cuda", 0)
    assert capped_free_bytes(device, None) == 10 * GIB  # the device's free memory
    assert capped_free_bytes(device, 8 * GIB) == 5 * GIB  # the cap less what the allocator holds
    assert capped_free_bytes(device, 20 * GIB) == 10 * GIB  # the device runs out first
    assert capped_free_bytes(device, 2 * GIB) == 0  # already above the cap



def test_kv_pool_from_a_fraction_of_what_the_cap_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.config import ModelConfig
    from runtime.engine import EngineConfig, num_kv_blocks
    from runtime.kv_cache import kv_bytes_per_block

    FakeCuda(monkeypatch, free=10 * GIB, reserved=3 * GIB)
    model_config = ModelConfig.preset("tiny")
    per_block = kv_bytes_per_block(model_config, 16, torch.bfloat16)
    config = EngineConfig(device="cuda", memory_cap_bytes=8 * GIB, kv_cache_memory_fraction=0.5,
                          max_num_running=10**6)
    assert num_kv_blocks(config, model_config) == int(0.5 * 5 * GIB) // per_block
    uncapped = EngineConfig(device="cuda", kv_cache_memory_fraction=0.5, max_num_running=10**6)
    assert num_kv_blocks(uncapped, model_config) == int(0.5 * 10 * GIB) // per_block


def test_memory_stats_report_the_allocator_and_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(monkeypatch, reserved=3 * GIB)
    assert memory_stats("cpu") is None
    assert memory_stats("cuda") == {"allocated": 2 * GIB, "reserved": 3 * GIB, "peak_reserved": 5 * GIB, "cap": 0,
                                    "device_used": 14 * GIB}  # 24 GiB card, 10 free
    cuda.fraction = 0.25
    assert memory_stats("cuda:0")["cap"] == 6 * GIB
