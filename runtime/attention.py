"""Attention over the paged KV cache (pure PyTorch) and the per-step metadata that drives it.

`AttentionMetadata.build` turns the scheduler's view of a step (new rows per sequence, context length,
block tables) into index tensors ONCE per step; every layer instance then calls `write_kv` and
`paged_attention` with the same metadata. `paged_attention(q, kv_cache, layer_idx, attn)` is the one
function a fused GPU kernel (Triton, FlashInfer) would replace.

Rows of the flat batch are grouped by sequence, in the order of `query_lens`. Sequences with one new
row (decode) are attended together in one padded call; sequences with several new rows (a prefill
chunk, causal within the chunk and over the earlier context) are attended one by one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.kv_cache import KVCache, read_rows, store_rows
from runtime.transfer import to_device


class AttentionMetadataError(ValueError):
    """The step description handed to `AttentionMetadata.build` is inconsistent."""


@dataclass(frozen=True)
class ChunkPlan:
    """Index tensors for one sequence that has more than one new row this step."""

    row_start: int  # first row of this sequence in the flat batch
    query_len: int
    key_slots: torch.Tensor  # [seq_len] cache slot of every position 0..seq_len-1
    mask: torch.Tensor | None  # [query_len, seq_len] True = may attend; None = plain causal (no context)


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's flat batch; see docs/contracts.md."""

    query_lens: list[int]  # [S] new rows per sequence this step
    seq_lens: list[int]  # [S] context length per sequence INCLUDING the new rows
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [N] block_id * block_size + offset for each new row
    logits_indices: torch.Tensor  # [S] index (into N) of each sequence's last new row
    block_size: int = 0
    # Derived by build(): single-row sequences attended in one padded call.
    decode_rows: torch.Tensor | None = None  # [Sd] row index (into N)
    decode_key_slots: torch.Tensor | None = None  # [Sd, Kmax] cache slots, padded with a valid slot
    decode_key_mask: torch.Tensor | None = None  # [Sd, Kmax] True for real context positions
    chunks: list[ChunkPlan] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """N: rows in the flat batch."""
        return sum(self.query_lens)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[N] positions of the new rows: seq_len - query_len .. seq_len - 1 per sequence."""
        parts = [torch.arange(s - q, s) for q, s in zip(self.query_lens, self.seq_lens)]
        return to_device(torch.cat(parts), device if device is not None else self.slot_mapping.device)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        *,
        plain_tensors: bool = True,
    ) -> AttentionMetadata:
        """Validate one step's layout and precompute the slot and mask tensors every layer reuses.

        `plain_tensors=False` leaves out what only `paged_attention` reads (`decode_rows`,
        `decode_key_slots`, `decode_key_mask`, `chunks`): the fast path's kernels read the block tables.
        """
        _validate(query_lens, seq_lens, block_tables, block_size)
        slots: list[int] = []
        chunks: list[ChunkPlan] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        decode_tables: list[list[int]] = []
        row = 0
        for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
            table = block_tables[i][: math.ceil(seq_len / block_size)]
            if query_len == 1:
                last = seq_len - 1
                slots.append(table[last // block_size] * block_size + last % block_size)
                decode_rows.append(row)
                decode_lens.append(seq_len)
                decode_tables.append(table)
            elif not plain_tensors:
                first = seq_len - query_len
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(first, seq_len))
            else:
                pos = torch.arange(seq_len)  # [seq_len]
                key_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size  # [seq_len]
                slots.extend(key_slots[seq_len - query_len :].tolist())
                mask = None
                if query_len != seq_len:
                    q_pos = torch.arange(seq_len - query_len, seq_len)  # [query_len]
                    mask = to_device(pos[None, :] <= q_pos[:, None], device)  # [query_len, seq_len]
                chunks.append(ChunkPlan(row, query_len, to_device(key_slots, device), mask))
            row += query_len
        slot_mapping = to_device(torch.tensor(slots, dtype=torch.long), device)  # [N]
        logits_indices = to_device(torch.tensor(query_lens, dtype=torch.long).cumsum(0) - 1, device)  # [S]
        meta = cls(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            block_tables=[list(t) for t in block_tables],
            slot_mapping=slot_mapping,
            logits_indices=logits_indices,
            block_size=block_size,
            chunks=chunks,
        )
        if decode_rows and plain_tensors:
            meta.decode_rows = to_device(torch.tensor(decode_rows, dtype=torch.long), device)
            max_blocks = max(len(t) for t in decode_tables)
            # Padding points at a real block of the same sequence; those positions are masked out.
            padded = [t + [t[0]] * (max_blocks - len(t)) for t in decode_tables]
            tables = torch.tensor(padded, dtype=torch.long)  # [Sd, max_blocks]
            lens = torch.tensor(decode_lens, dtype=torch.long)  # [Sd]
            pos = torch.arange(max(decode_lens))  # [Kmax]
            meta.decode_key_slots = to_device(tables[:, pos // block_size] * block_size + pos % block_size, device)
            meta.decode_key_mask = to_device(pos[None, :] < lens[:, None], device)  # [Sd, Kmax]
        return meta


def _validate(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
    if block_size < 1:
        raise AttentionMetadataError(f"block_size must be >= 1, got {block_size}")
    if not query_lens:
        raise AttentionMetadataError("a step needs at least one sequence")
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise AttentionMetadataError(
            f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    for i, (query_len, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        if query_len < 1 or seq_len < query_len:
            raise AttentionMetadataError(
                f"sequence {i}: need 1 <= query_len <= seq_len, got query_len={query_len}, seq_len={seq_len}"
            )
        needed = math.ceil(seq_len / block_size)
        if len(table) < needed:
            raise AttentionMetadataError(
                f"sequence {i}: {seq_len} positions need {needed} blocks of {block_size}, "
                f"block table has {len(table)}"
            )
        if any(b < 0 for b in table[:needed]):
            raise AttentionMetadataError(f"sequence {i}: negative block id in {table[:needed]}")


def write_kv(kv_cache: KVCache, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new rows' K/V ([N, kv_heads, head_dim]) at their slots of layer instance `layer_idx`."""
    scales = kv_cache.scales(layer_idx)
    store_rows(kv_cache.k[layer_idx], scales.get("k_scale"), slot_mapping, k)
    store_rows(kv_cache.v[layer_idx], scales.get("v_scale"), slot_mapping, v)


def paged_attention(q: torch.Tensor, kv_cache: KVCache, layer_idx: int, attn: AttentionMetadata) -> torch.Tensor:
    """Attention of the new rows' queries ([N, H, D]) over each sequence's cached K/V -> [N, H, D].

    The new rows' K/V must already be written (`write_kv`). GQA: query head h reads KV head
    h // (H // KV), as in Qwen3.
    """
    k_cache, v_cache = kv_cache.k[layer_idx], kv_cache.v[layer_idx]  # [num_blocks, block_size, KV, D]
    scales = kv_cache.scales(layer_idx)

    def keys(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [*slots.shape, KV, D] each
        return (read_rows(k_cache, scales.get("k_scale"), slots, q.dtype),
                read_rows(v_cache, scales.get("v_scale"), slots, q.dtype))

    out = torch.empty_like(q)  # [N, H, D]
    if attn.decode_rows is not None:
        assert attn.decode_key_slots is not None and attn.decode_key_mask is not None
        q_dec = q[attn.decode_rows].unsqueeze(2)  # [Sd, H, 1, D]
        k_dec, v_dec = (t.transpose(1, 2) for t in keys(attn.decode_key_slots))  # [Sd, KV, Kmax, D] each
        mask = attn.decode_key_mask[:, None, None, :]  # [Sd, 1, 1, Kmax]
        o = F.scaled_dot_product_attention(q_dec, k_dec, v_dec, attn_mask=mask, enable_gqa=True)
        out[attn.decode_rows] = o.squeeze(2)  # [Sd, H, D]
    for chunk in attn.chunks:
        rows = slice(chunk.row_start, chunk.row_start + chunk.query_len)
        q_c = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        k_c, v_c = (t.transpose(0, 1).unsqueeze(0) for t in keys(chunk.key_slots))  # [1, KV, K, D] each
        if chunk.mask is None:
            o = F.scaled_dot_product_attention(q_c, k_c, v_c, is_causal=True, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=chunk.mask, enable_gqa=True)
        out[rows] = o.squeeze(0).transpose(0, 1)  # [Q, H, D]
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Reference: plain causal GQA attention of one whole sequence, computed in float32.

    q: [T, H, D]; k, v: [T, KV, D] -> [T, H, D]. Written without SDPA so tests compare two
    independent computations.
    """
    num_heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // kv_heads
    qf = q.float().transpose(0, 1)  # [H, T, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, T, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, T, D]
    scores = qf @ kf.transpose(1, 2) / math.sqrt(head_dim)  # [H, T, T]
    seq_len = q.shape[0]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = scores.softmax(dim=-1) @ vf  # [H, T, D]
    return out.transpose(0, 1).to(q.dtype)  # [T, H, D]
