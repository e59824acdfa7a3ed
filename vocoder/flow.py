"""Token-to-mel flow: code encoder + causal estimator integrated with Euler from seeded noise (CFM)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vocoder.config import NUM_MELS, SPEAKER_EMBED_DIM, EstimatorConfig, FlowConfig
from vocoder.flow_encoder import CodeEncoder
from vocoder.flow_layers import (
    CausalBlock,
    CausalConv1d,
    CausalResnetBlock,
    ChunkTransformer,
    ConvCache,
    TimestepEmbedding,
)
from vocoder.layout import cat_channels, pointwise_conv


class FlowEstimator(nn.Module):
    """Velocity field v(x, mu, spk, cond, t), causal over mel frames (CosyVoice2 decoder layout).

    down (resnet + transformers + causal conv), `num_mid_blocks` x (resnet + transformers),
    up (resnet over [h, skip] + transformers + causal conv), final causal block, 1x1 projection.
    """

    def __init__(self, cfg: EstimatorConfig):
        super().__init__()
        in_ch, ch, tdim = 4 * NUM_MELS, cfg.channels, cfg.time_embed_dim

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(
                ChunkTransformer(ch, cfg.num_heads, cfg.head_dim, cfg.ffn_mult, cfg.attention_chunk_frames)
                for _ in range(cfg.num_transformers_per_block)
            )

        self.time_embed = TimestepEmbedding(in_ch, tdim)
        self.down_res = CausalResnetBlock(in_ch, ch, tdim)
        self.down_tf = transformers()
        self.down_conv = CausalConv1d(ch, ch, 3)
        self.mid_res = nn.ModuleList(CausalResnetBlock(ch, ch, tdim) for _ in range(cfg.num_mid_blocks))
        self.mid_tf = nn.ModuleList(transformers() for _ in range(cfg.num_mid_blocks))
        self.up_res = CausalResnetBlock(2 * ch, ch, tdim)
        self.up_tf = transformers()
        self.up_conv = CausalConv1d(ch, ch, 3)
        self.final_block = CausalBlock(ch, ch)
        self.final_proj = nn.Conv1d(ch, NUM_MELS, 1)
        # Activations stored channels-last (vocoder/layout.py): set with the Triton kernels on CUDA, whose
        # convs keep that layout, so the transformers (frames as rows) and the 1x1 convs need no copies.
        self.channels_last = False

    @property
    def resnets(self) -> list[CausalResnetBlock]:
        """The resnet blocks in call order."""
        return [self.down_res, *self.mid_res, self.up_res]

    def time_biases(self, t: torch.Tensor) -> list[torch.Tensor]:
        """t [N] -> per resnet (call order) the [N, C] it adds after its first block: a function of t alone,
        so an Euler solve computes those of all its steps at once."""
        t_emb = self.time_embed(t)  # [N, tdim]
        return [res.time_bias(t_emb) for res in self.resnets]

    def forward(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        spk: torch.Tensor,
        cond: torch.Tensor,
        t: torch.Tensor,
        cache: ConvCache,
        time_biases: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x, mu, cond [B, 80, T]; spk [B, 80]; t [B] -> velocity [B, 80, T].

        time_biases: `time_biases(t)` when the caller has it (then t is not read)."""
        parts = [x, mu, spk[:, :, None].expand(-1, -1, x.shape[2]), cond]
        h = cat_channels(parts, self.channels_last)  # [B, 320, T]
        biases = iter(self.time_biases(t) if time_biases is None else time_biases)
        h = _transformers(self.down_tf, self.down_res(h, next(biases), cache))
        skip = h
        h = self.down_conv(h, cache)
        for res, tfs in zip(self.mid_res, self.mid_tf):
            h = _transformers(tfs, res(h, next(biases), cache))
        h = _transformers(self.up_tf, self.up_res(cat_channels([h, skip]), next(biases), cache))
        h = self.up_conv(h, cache)
        return pointwise_conv(self.final_proj, self.final_block(h, cache))


def _transformers(blocks: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """[B, C, T] -> [B, C, T] through transformer blocks that work on [B, T, C] (one layout change each way)."""
    x = h.transpose(1, 2)
    for block in blocks:
        x = block(x)
    return x.transpose(1, 2)


class FlowDecoder(nn.Module):
    """codes + voice -> mel, in whole-sequence mode or chunk by chunk with per-step conv caches."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = CodeEncoder(cfg.encoder)
        self.spk_affine = nn.Linear(SPEAKER_EMBED_DIM, NUM_MELS)
        self.estimator = FlowEstimator(cfg.estimator)
        # cosine schedule: t_k = 1 - cos(pi/2 * k/K)
        self.t_span = [1.0 - math.cos(math.pi / 2 * k / cfg.num_steps) for k in range(cfg.num_steps + 1)]
        # the steps' start times on the device (no host copy inside a captured CUDA graph); not a weight
        self.register_buffer("step_times", torch.tensor(self.t_span[:-1], dtype=torch.float32), persistent=False)

    @property
    def num_branches(self) -> int:
        """2 with classifier-free guidance (conditional + unconditional rows), else 1."""
        return 2 if self.cfg.cfg_rate > 0 else 1

    def speaker_condition(self, speaker_embedding: torch.Tensor) -> torch.Tensor:
        """[B, 192] -> [B, 80] (L2-normalised, then projected)."""
        return self.spk_affine(F.normalize(speaker_embedding, dim=1))

    @torch.no_grad()
    def cache_shapes(self) -> list[tuple[int, int]]:
        """(channels, context frames) of every estimator conv cache, in call order."""
        p = next(self.parameters())
        t = self.cfg.estimator.attention_chunk_frames
        z = torch.zeros(1, NUM_MELS, t, device=p.device, dtype=p.dtype)
        cache = ConvCache(None, torch.full((1,), t, dtype=torch.long, device=p.device))
        self.estimator(z, z, z[:, :, 0], z, torch.zeros(1, device=p.device), cache)
        return [(c.shape[1], c.shape[2]) for c in cache.updated]

    @torch.no_grad()
    def solve(
        self,
        mu: torch.Tensor,
        spk: torch.Tensor,
        cond: torch.Tensor,
        noise: torch.Tensor,
        step_caches: list[list[torch.Tensor]] | None = None,
        num_valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Euler-integrate dx/dt = v from noise at t=0 to the mel at t=1.

        mu, cond, noise [B, 80, T]; spk [B, 80] (already projected). Whole mode: step_caches=None.
        Streaming: step_caches[k] holds step k's conv caches ([branches*B, C, ctx] each, conditional rows
        first) and num_valid [B] the new frames per row; returns the mel [B, 80, T] and the updated caches.
        """
        branches = self.num_branches
        b = mu.shape[0]
        x = noise.to(mu.dtype)
        if branches == 2:
            mu_in = torch.cat([mu, torch.zeros_like(mu)])  # unconditional rows drop mu, spk, cond
            spk_in = torch.cat([spk, torch.zeros_like(spk)])
            cond_in = torch.cat([cond, torch.zeros_like(cond)])
        else:
            mu_in, spk_in, cond_in = mu, spk, cond
        valid_in = None if num_valid is None else num_valid.repeat(branches)  # [branches*B]
        new_caches: list[list[torch.Tensor]] = []
        steps = self.cfg.num_steps
        t_all = self.step_times.to(x.dtype)  # [K]
        biases = self.estimator.time_biases(t_all)  # per resnet [K, C]
        for k in range(steps):
            t0, t1 = self.t_span[k], self.t_span[k + 1]
            cache = ConvCache(None if step_caches is None else step_caches[k], valid_in)
            x_in = x.repeat(branches, 1, 1)  # [branches*B, 80, T]
            step_biases = [bias[k].expand(branches * b, -1) for bias in biases]  # same t on every row
            v = self.estimator(x_in, mu_in, spk_in, cond_in, t_all[k], cache, step_biases)
            if branches == 2:
                v_cond, v_uncond = v[:b], v[b:]
                v = (1.0 + self.cfg.cfg_rate) * v_cond - self.cfg.cfg_rate * v_uncond
            x = x + (t1 - t0) * v
            new_caches.append(cache.updated)
        return x, new_caches
