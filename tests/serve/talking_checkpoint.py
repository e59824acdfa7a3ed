"""A synthetic tiny checkpoint whose output shape is predictable, for the HTTP tests.

The `tiny` preset has random weights: its text head almost never picks one of the 256 byte tokens the
tiny tokenizer can decode, and it leaves audio mode (EOSP) about once in 16k steps. So a chat test
could never see text. This checkpoint is the real tiny architecture (fewer layers, for speed), saved
with `runtime.weights.save_checkpoint` and loaded by the real engine through `load_pretrained`, with
a few weights set by hand:

- hidden dimension 0 carries a constant (embeddings set it; no layer writes to it), and both final
  norms keep only that dimension, so both heads see the same vector at every position;
- the text head then favours the letters a-z (never a stop token), and the audio head favours
  codes 0-255 with EOSP highest.

Result: an audio-output request yields exactly `min_new_tokens` codes (EOSP is masked until then and
near-certain afterwards), then EOSP, then letters until `max_new_tokens`. Codes still depend on the
seed (sampling among equally likely codes), so different seeds give different audio.
"""
from __future__ import annotations

from pathlib import Path

import torch

from runtime.config import EOSP_ID, ModelConfig
from runtime.model import build_model
from runtime.weights import save_checkpoint

CONSTANT = 100.0  # value of hidden dim 0; dominates every RMSNorm
LETTERS = range(ord("a"), ord("z") + 1)


def write_talking_checkpoint(path: Path, *, num_shared_layers: int = 2, num_modality_layers: int = 1) -> Path:
    """Write the checkpoint folder (config.json, safetensors, tokenizer.json) and return it."""
    config = ModelConfig.preset("tiny").replace(num_shared_layers=num_shared_layers,
                                                num_modality_layers=num_modality_layers)
    model = build_model(config, seed=0)
    params = dict(model.named_parameters())
    with torch.no_grad():
        params["model.embed_tokens.weight"][:, 0] = CONSTANT
        params["model.audio_embed.weight"][:, 0] = CONSTANT
        for name, param in params.items():
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                param[0, :] = 0.0  # no layer writes to dim 0
        for norm in ("model.text_norm.weight", "model.audio_norm.weight"):
            params[norm].zero_()
            params[norm][0] = 1.0
        text_head = params["text_lm_head.weight"]
        text_head.zero_()
        text_head[:, 0] = -2.0
        text_head[list(LETTERS), 0] = 1.0
        audio_head = params["audio_lm_head.weight"]
        audio_head.zero_()
        audio_head[:, 0] = -2.0
        audio_head[:256, 0] = 0.5
        audio_head[EOSP_ID, 0] = 1.5
    save_checkpoint(model, path)
    return path
