"""Regenerate vocoder/voices/default.safetensors deterministically (a synthetic voice for tiny and tests).

Run: `python -m vocoder.make_default_voice [--out PATH] [--seed N]`. The prompt mel is a smooth log-mel-like
pattern (harmonic ridges under a falling envelope), not a recording: real voices come from CAM++ and the
codec encoder and are dropped into a voices folder as `<name>.safetensors`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from vocoder.config import MEL_FRAMES_PER_CODE, NUM_AUDIO_CODES, NUM_MELS, SPEAKER_EMBED_DIM
from vocoder.voices import DEFAULT_VOICES_DIR, Voice

NUM_PROMPT_CODES = 12  # ~1 s of prompt


def make_voice(name: str = "default", seed: int = 1234, num_prompt_codes: int = NUM_PROMPT_CODES) -> Voice:
    """A deterministic synthetic voice."""
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(SPEAKER_EMBED_DIM, generator=gen)
    emb = emb / emb.norm()
    codes = torch.randint(0, NUM_AUDIO_CODES, (num_prompt_codes,), generator=gen)
    frames = MEL_FRAMES_PER_CODE * num_prompt_codes
    t = torch.arange(frames, dtype=torch.float64)[:, None]  # [F, 1]
    m = torch.arange(NUM_MELS, dtype=torch.float64)[None, :]  # [1, M]
    f0_bin = 6.0 + 2.0 * torch.sin(2 * math.pi * t / 37.0)  # slowly moving pitch ridge
    ridges = torch.cos(2 * math.pi * m / f0_bin).clamp(min=0) ** 4  # harmonic ridges
    envelope = -2.0 - 6.0 * m / NUM_MELS  # falling spectral tilt (log units)
    mel = envelope + 2.0 * ridges + 0.1 * torch.randn(frames, NUM_MELS, generator=gen, dtype=torch.float64)
    return Voice(name=name, speaker_embedding=emb.float(), prompt_codes=codes, prompt_mel=mel.float())


def main() -> None:
    """Write the default voice file."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_VOICES_DIR / "default.safetensors")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    make_voice(seed=args.seed).save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
