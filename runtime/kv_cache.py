"""Paged KV cache storage: one tensor pair shared by all layer instances, addressed by block id.

Layout: `k`, `v` are `[L, num_blocks, block_size, kv_heads, head_dim]` with L = num_layer_instances
(shared 0..S-1, text tail S..S+M-1, audio tail S+M..S+2M-1). A block id therefore addresses the same
slot in every layer instance, so the block manager allocates one id per `block_size` positions and
both tails keep their own K/V at every position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config import ModelConfig


class KVCacheConfigError(ValueError):
    """A KV cache was asked for with an impossible size."""


@dataclass
class KVCache:
    """The paged K and V tensors of every layer instance."""

    k: torch.Tensor  # [L, num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor  # [L, num_blocks, block_size, kv_heads, head_dim]
    block_size: int

    def __post_init__(self) -> None:
        assert self.k.shape == self.v.shape and self.k.dim() == 5, (self.k.shape, self.v.shape)
        assert self.k.shape[2] == self.block_size, (self.k.shape, self.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks per layer instance (the same id is valid in every layer instance)."""
        return int(self.k.shape[1])

    @property
    def num_layer_instances(self) -> int:
        """Length of the layer axis."""
        return int(self.k.shape[0])


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layer instances, K and V together."""
    if block_size < 1:
        raise KVCacheConfigError(f"block_size must be >= 1, got {block_size}")
    element_size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_layer_instances * config.num_key_value_heads * config.head_dim * element_size
    return per_token * block_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many whole blocks fit into `budget_bytes` (0 when not even one does)."""
    if budget_bytes < 0:
        raise KVCacheConfigError(f"KV cache budget must be >= 0 bytes, got {budget_bytes}")
    return int(budget_bytes) // kv_bytes_per_block(config, block_size, dtype)


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str, dtype: torch.dtype
) -> KVCache:
    """Zero-filled cache of `num_blocks` blocks for every layer instance of `config`."""
    if num_blocks < 1:
        raise KVCacheConfigError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise KVCacheConfigError(f"block_size must be >= 1, got {block_size}")
    shape = (config.num_layer_instances, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    k = torch.zeros(shape, device=device, dtype=dtype)
    v = torch.zeros(shape, device=device, dtype=dtype)
    return KVCache(k=k, v=v, block_size=block_size)
