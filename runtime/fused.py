"""Load-time weight fusion: QKV and gate/up as single matrices, without renaming or copying twice.

`fuse_model_weights(model)` allocates one [(H + 2KV) * D, hidden] buffer per layer for q/k/v and one
[2I, hidden] buffer for gate/up, copies the weights in, and makes the original parameters VIEWS of
those buffers (row slices, so each stays contiguous). The module tree, the state_dict keys (the
checkpoint names) and the memory footprint are unchanged; the fast path reads the fused buffers.
Call it after the checkpoint is loaded (a loader that replaces parameters would break the views).
`with_fp8(weights, scope)` returns a copy whose matrices are FP8 (runtime/fp8.py).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from runtime.config import ModelConfig
from runtime.fp8 import Fp8Weight, Weight, quantize_weight
from runtime.layers import DecoderLayer
from runtime.model import MossSpeechForCausalLM


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the fast path reads it; `layer_idx` is its KV cache layer instance."""

    layer_idx: int
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    qkv: Weight  # [(H + 2KV) * D, hidden]
    o: Weight  # [hidden, H * D]
    gate_up: Weight  # [2I, hidden]
    down: Weight  # [hidden, I]

    def matrices(self) -> dict[str, Weight]:
        return {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}


@dataclass(frozen=True)
class FusedWeights:
    """Every tensor one step needs, fused; shares storage with the model's parameters."""

    config: ModelConfig
    embed_text: torch.Tensor  # [Vt, hidden]
    embed_audio: torch.Tensor  # [Va, hidden]
    shared: tuple[LayerWeights, ...]
    text: tuple[LayerWeights, ...]
    audio: tuple[LayerWeights, ...]
    text_norm: torch.Tensor  # [hidden]
    audio_norm: torch.Tensor  # [hidden]
    text_head: Weight  # [Vt, hidden]
    audio_head: Weight  # [Va, hidden]

    def matrix_bytes(self) -> int:
        """Bytes of every matrix a decode step streams (layers and heads; embeddings excluded)."""
        total = 0
        for layer in (*self.shared, *self.text, *self.audio):
            total += sum(_nbytes(w) for w in layer.matrices().values())
        return total + _nbytes(self.text_head) + _nbytes(self.audio_head)

    def audio_only_matrix_bytes(self) -> int:
        """Bytes an audio-only decode step streams (`FastForward(text=False)`): all but the text tail's last
        o, gate/up and down matrices and the text head."""
        last = self.text[-1]
        return self.matrix_bytes() - sum(_nbytes(w) for w in (last.o, last.gate_up, last.down, self.text_head))


def _nbytes(w: Weight) -> int:
    if isinstance(w, Fp8Weight):
        return w.nbytes()
    return w.numel() * w.element_size()


def _fuse_rows(modules: list[nn.Linear]) -> torch.Tensor:
    """Stack the modules' weights row-wise into one buffer and turn each weight into a view of it."""
    weights = [m.weight for m in modules]
    rows = sum(w.shape[0] for w in weights)
    first = weights[0]
    if _already_fused(weights):
        return first.detach().as_strided((rows, first.shape[1]), first.stride(), first.storage_offset())
    fused = torch.empty(rows, first.shape[1], device=first.device, dtype=first.dtype)  # [sum N, K]
    start = 0
    for module, w in zip(modules, weights):
        fused[start : start + w.shape[0]].copy_(w.detach())
        start += w.shape[0]
    start = 0
    for module, w in zip(modules, weights):
        module.weight = nn.Parameter(fused[start : start + w.shape[0]], requires_grad=False)
        start += w.shape[0]
    return fused


def _already_fused(weights: list[torch.Tensor]) -> bool:
    """True when the weights already lie back to back in one storage (a second fuse is then free)."""
    for prev, nxt in itertools.pairwise(weights):
        same = prev.untyped_storage().data_ptr() == nxt.untyped_storage().data_ptr()
        if not same or prev.storage_offset() + prev.numel() != nxt.storage_offset():
            return False
    return all(w.is_contiguous() for w in weights)


def _layer_weights(layer: DecoderLayer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    return LayerWeights(
        layer_idx=layer.layer_idx,
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        q_norm=attn.q_norm.weight.detach(),
        k_norm=attn.k_norm.weight.detach(),
        qkv=_fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj]),
        o=attn.o_proj.weight.detach(),
        gate_up=_fuse_rows([mlp.gate_proj, mlp.up_proj]),
        down=mlp.down_proj.weight.detach(),
    )


@torch.no_grad()
def fuse_model_weights(model: MossSpeechForCausalLM, *, deferred: tuple[str, ...] = ()) -> FusedWeights:
    """Fuse QKV and gate/up of every layer in place (parameters become views) and collect the weights.
    The blocks named in `deferred` ("shared", "text", "audio") are left unfused, as empty tuples, for a
    caller that fuses them a layer at a time (`quantize_model_in_place`).

    On CUDA the allocator's cache is emptied afterwards: the separate q/k/v/gate/up blocks freed by the
    fusion would otherwise stay reserved (measured: ~4 GiB of the 24 GB profile) and fit nothing larger.
    """
    m = model.model

    def layers(block: str) -> tuple[LayerWeights, ...]:
        if block in deferred:
            return ()
        return tuple(_layer_weights(layer) for layer in getattr(m, f"{block}_block").layers)

    weights = FusedWeights(
        config=model.config,
        embed_text=m.embed_tokens.weight.detach(),
        embed_audio=m.audio_embed.weight.detach(),
        shared=layers("shared"),
        text=layers("text"),
        audio=layers("audio"),
        text_norm=m.text_norm.weight.detach(),
        audio_norm=m.audio_norm.weight.detach(),
        text_head=model.text_lm_head.weight.detach(),
        audio_head=model.audio_lm_head.weight.detach(),
    )
    if weights.embed_text.is_cuda:
        torch.cuda.empty_cache()
    return weights


FP8_SCOPES = ("shared", "layers", "all")


@torch.no_grad()
def with_fp8(weights: FusedWeights, scope: str = "all") -> FusedWeights:
    """A copy with FP8 matrices: "shared" = the 32 shared layers, "layers" = every decoder layer,
    "all" = every layer and both heads. Norms and embeddings stay in their dtype."""
    if scope not in FP8_SCOPES:
        raise ValueError(f"fp8 scope must be one of {FP8_SCOPES}, got {scope!r}")

    def quantize_layers(layers: tuple[LayerWeights, ...]) -> tuple[LayerWeights, ...]:
        return tuple(
            dataclasses.replace(layer, **{k: quantize_weight(w) for k, w in layer.matrices().items()})
            for layer in layers
        )

    fp8 = dataclasses.replace(weights, shared=quantize_layers(weights.shared))
    if scope in ("layers", "all"):
        fp8 = dataclasses.replace(fp8, text=quantize_layers(weights.text), audio=quantize_layers(weights.audio))
    if scope == "all":
        fp8 = dataclasses.replace(
            fp8, text_head=quantize_weight(weights.text_head), audio_head=quantize_weight(weights.audio_head)
        )
    return fp8


@torch.no_grad()
def quantize_model_in_place(
    model: MossSpeechForCausalLM, scope: str = "all", device: torch.device | str | None = None
) -> FusedWeights:
    """Fuse and quantize the `scope` matrices to FP8 one layer at a time, releasing each bf16 matrix as
    soon as its FP8 twin exists. The model's parameters for those matrices become empty, so only the fast
    path can run the model afterwards.

    device None: everything stays where it is (peak: bf16 weights + one layer). Given a device (the model
    loaded on the CPU), every tensor that stays bf16 moves there first, and each matrix to quantize moves
    there only for its own quantization, so the device never holds more than the FP8 model, the bf16
    remainder (embeddings, norms; the heads or tails outside `scope`) and one bf16 matrix; the host holds
    the loaded model (file mappings, with `load_pretrained(mapped=True)`) and one layer's fused copies."""
    if scope not in FP8_SCOPES:
        raise ValueError(f"fp8 scope must be one of {FP8_SCOPES}, got {scope!r}")
    blocks = ("shared",) if scope == "shared" else ("shared", "text", "audio")
    target = None if device is None else torch.device(device)
    if target is not None:
        _move_all_but_quantized(model, scope, blocks, target)
    weights = fuse_model_weights(model, deferred=blocks)
    fields = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}
    del weights

    def quantize(w: torch.Tensor) -> Weight:
        return quantize_weight(w if target is None else w.to(target))

    for block in blocks:
        layers: list[LayerWeights] = []
        for module in getattr(model.model, f"{block}_block").layers:
            layer = _layer_weights(module)  # fuses this layer (on the CPU when staged)
            layers.append(dataclasses.replace(layer, **{k: quantize(w) for k, w in layer.matrices().items()}))
            for linear in _layer_linears(module):
                _release(linear, target)
            del layer
        fields[block] = tuple(layers)
    if scope == "all":
        for name, linear in (("text_head", model.text_lm_head), ("audio_head", model.audio_lm_head)):
            fields[name] = quantize(fields.pop(name))
            _release(linear, target)
    if fields["embed_text"].is_cuda:
        torch.cuda.empty_cache()
    return FusedWeights(**fields)


def _quantized_linears(model: MossSpeechForCausalLM, scope: str, blocks: tuple[str, ...]) -> list[nn.Linear]:
    """The linear layers whose matrices `scope` quantizes."""
    out = [linear for block in blocks for layer in getattr(model.model, f"{block}_block").layers
           for linear in _layer_linears(layer)]
    if scope == "all":
        out += [model.text_lm_head, model.audio_lm_head]
    return out


def _layer_linears(layer: DecoderLayer) -> list[nn.Linear]:
    """A decoder layer's seven projections."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def _move_all_but_quantized(model: MossSpeechForCausalLM, scope: str, blocks: tuple[str, ...],
                            target: torch.device) -> None:
    """Every parameter and buffer to `target`, except the weights of the linears `scope` quantizes."""
    skip = {id(linear.weight) for linear in _quantized_linears(model, scope, blocks)}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in skip and param.device != target:
                setattr(module, name, nn.Parameter(param.detach().to(target), requires_grad=False))
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.device != target:
                module._buffers[name] = buf.to(target)


def _release(linear: nn.Linear, device: torch.device | None = None) -> None:
    """Empty the linear's weight (on `device` when given, so the model reports the device it runs on)."""
    empty = torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device if device is None else device)
    linear.weight = nn.Parameter(empty, requires_grad=False)
