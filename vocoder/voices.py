"""Voices: small safetensors files (speaker embedding, prompt codes, prompt mel) looked up by name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from vocoder.config import MEL_FRAMES_PER_CODE, NUM_AUDIO_CODES, NUM_MELS, SPEAKER_EMBED_DIM
from vocoder.safetensors_io import read_safetensors

DEFAULT_VOICES_DIR = Path(__file__).parent / "voices"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True, eq=False)
class Voice:
    """What the flow is conditioned on: CAM++ speaker embedding, prompt codes and their mel."""

    name: str
    speaker_embedding: torch.Tensor  # [192] float32
    prompt_codes: torch.Tensor  # [P] int64, 0..16383
    prompt_mel: torch.Tensor  # [4P, 80] float32

    def __post_init__(self) -> None:
        emb, codes, mel = self.speaker_embedding, self.prompt_codes, self.prompt_mel
        if tuple(emb.shape) != (SPEAKER_EMBED_DIM,) or not emb.is_floating_point():
            raise ValueError(
                f"voice {self.name!r}: speaker_embedding must be float [{SPEAKER_EMBED_DIM}], got {emb.shape}"
            )
        if not bool(torch.isfinite(emb).all()) or float(emb.norm()) == 0.0:
            raise ValueError(f"voice {self.name!r}: speaker_embedding must be finite and non-zero")
        if codes.dim() != 1 or codes.is_floating_point():
            raise ValueError(
                f"voice {self.name!r}: prompt_codes must be an integer vector, got {codes.dtype} {codes.shape}"
            )
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= NUM_AUDIO_CODES):
            raise ValueError(f"voice {self.name!r}: prompt_codes must lie in 0..{NUM_AUDIO_CODES - 1}")
        want = (MEL_FRAMES_PER_CODE * codes.numel(), NUM_MELS)
        if tuple(mel.shape) != want or not mel.is_floating_point():
            raise ValueError(
                f"voice {self.name!r}: prompt_mel must be float {list(want)}, got {list(mel.shape)}"
            )
        if not bool(torch.isfinite(mel).all()):
            raise ValueError(f"voice {self.name!r}: prompt_mel has non-finite values")

    @property
    def num_prompt_codes(self) -> int:
        """P."""
        return int(self.prompt_codes.numel())

    @classmethod
    def load(cls, path: str | Path, name: str | None = None) -> Voice:
        """Read a voice file (safetensors with keys speaker_embedding, prompt_codes, prompt_mel)."""
        path = Path(path)
        tensors = read_safetensors(path, "voice file", floats_only=False)  # prompt_codes are integers
        missing = {"speaker_embedding", "prompt_codes", "prompt_mel"} - tensors.keys()
        if missing:
            raise ValueError(f"voice file {path} lacks {sorted(missing)}")
        # checked before the casts below, which would turn float codes into integers without a word
        if tensors["prompt_codes"].is_floating_point() or tensors["prompt_codes"].dtype == torch.bool:
            raise ValueError(f"voice file {path}: prompt_codes must be integers, got {tensors['prompt_codes'].dtype}")
        for key in ("speaker_embedding", "prompt_mel"):
            if not tensors[key].is_floating_point():
                raise ValueError(f"voice file {path}: {key} must be floating point, got {tensors[key].dtype}")
        return cls(
            name=name or path.stem,
            speaker_embedding=tensors["speaker_embedding"].float(),
            prompt_codes=tensors["prompt_codes"].long(),
            prompt_mel=tensors["prompt_mel"].float(),
        )

    def save(self, path: str | Path) -> None:
        """Write this voice as a safetensors file."""
        from safetensors.torch import save_file

        save_file(
            {
                "speaker_embedding": self.speaker_embedding.float().contiguous(),
                "prompt_codes": self.prompt_codes.to(torch.int32).contiguous(),
                "prompt_mel": self.prompt_mel.float().contiguous(),
            },
            str(path),
        )


class VoiceLibrary:
    """Voices of a folder (`<name>.safetensors`), loaded lazily and kept; "default" must exist."""

    def __init__(self, folder: str | Path = DEFAULT_VOICES_DIR):
        self.folder = Path(folder)
        if not (self.folder / "default.safetensors").is_file():
            raise ValueError(f"voices folder {self.folder} has no default.safetensors")
        self._cache: dict[str, Voice] = {}

    def names(self) -> list[str]:
        """Sorted names of the voices in the folder."""
        on_disk = {p.stem for p in self.folder.glob("*.safetensors") if _NAME.match(p.stem)}
        return sorted(on_disk | self._cache.keys())

    def get(self, name: str) -> Voice:
        """The voice called `name`; ValueError listing the known names if there is none."""
        if name in self._cache:
            return self._cache[name]
        known = self.names()
        if not isinstance(name, str) or name not in known:
            raise ValueError(f"unknown voice {name!r}; known voices: {', '.join(known)}")
        voice = Voice.load(self.folder / f"{name}.safetensors", name=name)
        self._cache[name] = voice
        return voice

    def add(self, voice: Voice) -> None:
        """Register an in-memory voice (e.g. built by a test) under its name."""
        if not _NAME.match(voice.name):
            raise ValueError(f"bad voice name {voice.name!r}")
        self._cache[voice.name] = voice
