"""MOSS-Speech: a Qwen3 backbone whose 32 shared layers feed two 4-layer tails (text, audio), each with
its own final norm and head. Both tails run on every step and keep their own KV at every position.

The module tree produces exactly the checkpoint's 446 tensor names (see docs/model.md).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from runtime.attention import AttentionMetadata, causal_attention, paged_attention, write_kv
from runtime.config import MODALITY_PAD_ID, ModelConfig, Row
from runtime.kv_cache import KVCache
from runtime.layers import AttentionBackend, LayerStack, RMSNorm, rotary_cos_sin

INIT_STD = 0.02


class ModelCheckError(AssertionError):
    """A `debug_checks` invariant failed: wrong logits shape or non-finite logits."""


class ModelInputError(ValueError):
    """Tokens, rows or positions handed to the model are malformed."""


def split_rows(rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows -> (selected token per row [T], is_audio [T]); a row is audio iff its text is the modality pad."""
    tokens: list[int] = []
    flags: list[bool] = []
    for i, row in enumerate(rows):
        if len(row) != 2:
            raise ModelInputError(f"row {i} must be (text id, audio id), got {row!r}")
        text, audio = int(row[0]), int(row[1])
        is_audio = text == MODALITY_PAD_ID
        tokens.append(audio if is_audio else text)
        flags.append(is_audio)
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(flags, dtype=torch.bool)


class _PagedBackend:
    """Write the new rows' K/V into the paged cache, then attend over each sequence's pages."""

    def __init__(self, kv_cache: KVCache, attn: AttentionMetadata) -> None:
        self.kv_cache = kv_cache
        self.attn = attn

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(self.kv_cache, layer_idx, k, v, self.attn.slot_mapping)
        return paged_attention(q, self.kv_cache, layer_idx, self.attn)


def _reference_backend(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return causal_attention(q, k, v)


class MossSpeechModel(nn.Module):
    """Embeddings, shared block, both tails and their final norms (checkpoint prefix `model.`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        shared, modality = config.num_shared_layers, config.num_modality_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.audio_embed = nn.Embedding(config.audio_vocab_size, config.hidden_size)
        self.shared_block = LayerStack(config, shared, first_layer_idx=0)
        self.text_block = LayerStack(config, modality, first_layer_idx=shared)
        self.audio_block = LayerStack(config, modality, first_layer_idx=shared + modality)
        self.text_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.audio_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, tokens: torch.Tensor, is_audio: torch.Tensor) -> torch.Tensor:
        """[N] tokens -> [N, hidden]: text table for text rows, audio table for audio rows (never a sum)."""
        out = torch.empty(
            tokens.shape[0], self.embed_tokens.embedding_dim,
            device=tokens.device, dtype=self.embed_tokens.weight.dtype,
        )  # [N, hidden]
        text_rows = ~is_audio
        out[text_rows] = self.embed_tokens(tokens[text_rows])
        out[is_audio] = self.audio_embed(tokens[is_audio])
        return out


class MossSpeechForCausalLM(nn.Module):
    """The whole model: `forward` runs one engine step on the paged KV cache, `reference_forward` a whole
    sequence without a cache. Both return float32 logits of the text and audio heads."""

    def __init__(self, config: ModelConfig, *, debug_checks: bool = False) -> None:
        super().__init__()
        self.config = config
        self.debug_checks = debug_checks
        self.model = MossSpeechModel(config)
        self.text_lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.audio_lm_head = nn.Linear(config.hidden_size, config.audio_vocab_size, bias=False)

    def _run(
        self, tokens: torch.Tensor, is_audio: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
        select: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.debug_checks:
            self._check_inputs(tokens, is_audio, positions)
        m = self.model
        hidden = m.embed(tokens, is_audio)  # [N, hidden]
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        shared = m.shared_block(hidden, cos, sin, backend)  # [N, hidden]
        text = m.text_block(shared, cos, sin, backend)  # [N, hidden]
        audio = m.audio_block(shared, cos, sin, backend)  # [N, hidden]
        if select is not None:
            text, audio = text[select], audio[select]  # [S, hidden]
        text_logits = self.text_lm_head(m.text_norm(text)).float()  # [S, Vt]
        audio_logits = self.audio_lm_head(m.audio_norm(audio)).float()  # [S, Va]
        if self.debug_checks:
            expected = tokens.shape[0] if select is None else select.shape[0]
            self._check_logits(text_logits, audio_logits, expected)
        return text_logits, audio_logits

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        is_audio: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over N new rows: writes their K/V at `attn.slot_mapping` in all layer instances and
        returns logits [S, Vt], [S, Va] for the rows `attn.logits_indices`."""
        if self.debug_checks:
            if tokens.shape[0] != attn.num_rows:
                raise ModelInputError(f"{tokens.shape[0]} rows given, metadata describes {attn.num_rows}")
            if kv_cache.num_layer_instances != self.config.num_layer_instances:
                raise ModelInputError(
                    f"KV cache has {kv_cache.num_layer_instances} layer instances, "
                    f"model needs {self.config.num_layer_instances}"
                )
        backend = _PagedBackend(kv_cache, attn)
        return self._run(tokens, is_audio, positions, backend, attn.logits_indices)

    @torch.inference_mode()
    def reference_forward(self, rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequence, plain causal attention, no cache: logits [T, Vt], [T, Va] at every position."""
        if len(rows) == 0:
            raise ModelInputError("reference_forward needs at least one row")
        device = self.text_lm_head.weight.device
        tokens, is_audio = split_rows(rows)
        tokens, is_audio = tokens.to(device), is_audio.to(device)
        positions = torch.arange(len(rows), device=device)
        return self._run(tokens, is_audio, positions, _reference_backend, None)

    def _check_inputs(self, tokens: torch.Tensor, is_audio: torch.Tensor, positions: torch.Tensor) -> None:
        if not tokens.shape == is_audio.shape == positions.shape or tokens.dim() != 1:
            raise ModelInputError(
                f"tokens {tuple(tokens.shape)}, is_audio {tuple(is_audio.shape)} and positions "
                f"{tuple(positions.shape)} must all be [N]"
            )
        text_ids, audio_ids = tokens[~is_audio], tokens[is_audio]
        if text_ids.numel() and not (0 <= int(text_ids.min()) and int(text_ids.max()) < self.config.vocab_size):
            raise ModelInputError(f"text token ids must lie in [0, {self.config.vocab_size})")
        if audio_ids.numel() and not (
            0 <= int(audio_ids.min()) and int(audio_ids.max()) < self.config.audio_vocab_size
        ):
            raise ModelInputError(f"audio token ids must lie in [0, {self.config.audio_vocab_size})")
        if positions.numel() and not (
            0 <= int(positions.min()) and int(positions.max()) < self.config.max_position_embeddings
        ):
            raise ModelInputError(f"positions must lie in [0, {self.config.max_position_embeddings})")

    def _check_logits(self, text_logits: torch.Tensor, audio_logits: torch.Tensor, rows: int) -> None:
        if tuple(text_logits.shape) != (rows, self.config.vocab_size):
            raise ModelCheckError(f"text logits shape {tuple(text_logits.shape)} != {(rows, self.config.vocab_size)}")
        if tuple(audio_logits.shape) != (rows, self.config.audio_vocab_size):
            raise ModelCheckError(
                f"audio logits shape {tuple(audio_logits.shape)} != {(rows, self.config.audio_vocab_size)}"
            )
        for name, logits in (("text", text_logits), ("audio", audio_logits)):
            if not bool(torch.isfinite(logits).all()):
                bad = int((~torch.isfinite(logits)).sum())
                raise ModelCheckError(f"{name} logits contain {bad} non-finite values")


def build_meta_model(config: ModelConfig, *, debug_checks: bool = False) -> MossSpeechForCausalLM:
    """The module tree with every parameter on the meta device (no memory); fill it with `set_parameter`."""
    with torch.device("meta"):
        return MossSpeechForCausalLM(config, debug_checks=debug_checks)


def set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace parameter `name` (a dotted state_dict key) by `tensor`, frozen for inference."""
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    setattr(module, attr, nn.Parameter(tensor, requires_grad=False))


def build_model(
    config: ModelConfig,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    debug_checks: bool = False,
    on_host: bool = False,
) -> MossSpeechForCausalLM:
    """Random weights, deterministic for (seed, device type, dtype): normal(0, 0.02) matrices, norms = 1.

    Each parameter is created directly on `device` in `dtype`, so the full model never exists in
    float32 on the host. `on_host`: each parameter is drawn on `device` (the same numbers) and then moved to
    host memory, so the device holds one parameter at a time (FP8 staging quantizes them onto it later).
    """
    model = build_meta_model(config, debug_checks=debug_checks)
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, param in list(model.named_parameters()):
        if name.endswith("norm.weight"):  # RMSNorm weights (incl. q_norm, k_norm, layernorms)
            tensor = torch.ones(param.shape, device=device, dtype=dtype)
        else:
            tensor = torch.empty(param.shape, device=device, dtype=dtype)
            tensor.normal_(0.0, INIT_STD, generator=generator)
        set_parameter(model, name, tensor.cpu() if on_host else tensor)
    return model.eval()
