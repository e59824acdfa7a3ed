"""StreamingVocoder: codes -> 24 kHz PCM, one session per stream, sessions batched per step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from vocoder.config import HOP_LENGTH, LOOKAHEAD_CODES, MEL_FRAMES_PER_CODE, VocoderConfig
from vocoder.flow import FlowDecoder
from vocoder.mel_vocoder import build_generator, receptive_field_frames, vocode
from vocoder.noise import batch_frame_noise, check_seed, frame_noise
from vocoder.session import VocoderSession, check_codes
from vocoder.state_pool import FlowStatePool
from vocoder.voices import DEFAULT_VOICES_DIR, Voice, VoiceLibrary

_F = MEL_FRAMES_PER_CODE
_EMPTY = np.zeros(0, dtype=np.float32)


class StreamingVocoder:
    """Streaming codec decoder (flow matching to mel, BigVGAN to PCM); see docs/vocoder.md.

    Over a session's life the PCM returned by push/step/finish adds up to exactly
    SAMPLES_PER_CODE * codes pushed, and equals `decode_whole` on the same codes within float rounding,
    whatever the chunking and whichever other sessions share a step. Not thread-safe: drive one instance
    from one thread (or event loop) at a time.
    """

    def __init__(
        self,
        config: VocoderConfig,
        flow: FlowDecoder,
        generator: torch.nn.Module,
        voices: VoiceLibrary,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.flow = flow.to(device=self.device, dtype=dtype).eval()
        self.generator = generator.to(device=self.device, dtype=dtype).eval()
        self.voices = voices
        exact_left, exact_right = receptive_field_frames(self.generator)
        stream = config.stream
        self.left_context = (
            exact_left if stream.vocoder_left_context_frames is None else stream.vocoder_left_context_frames
        )
        self.right_context = (
            exact_right
            if stream.vocoder_right_context_frames is None
            else stream.vocoder_right_context_frames
        )
        self.history_codes = config.flow.encoder.left_context_codes
        self.pool = FlowStatePool(
            self.flow.cache_shapes(),
            config.flow.num_steps,
            self.flow.num_branches,
            device=self.device,
            dtype=dtype,
        )
        self._voice_mel: dict[str, torch.Tensor] = {}

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        voices_dir: str | Path | None = None,
        flow_checkpoint: str | Path | None = None,
        bigvgan_checkpoint: str | Path | None = None,
        config: VocoderConfig | None = None,
    ) -> StreamingVocoder:
        """Build `tiny` or `full` (random deterministic weights from `seed` unless checkpoints are given).

        dtype None means float32. Checkpoints are safetensors state dicts (flow: FlowDecoder keys;
        BigVGAN: generator keys). `config` overrides the preset (e.g. other Euler steps or chunking).
        """
        cfg = config if config is not None else VocoderConfig.preset(name)
        cfg.validate()
        torch_dtype = _resolve_dtype(dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            flow = FlowDecoder(cfg.flow)
        if flow_checkpoint is not None:
            from safetensors.torch import load_file

            if Path(flow_checkpoint).suffix != ".safetensors":
                raise ValueError(f"flow checkpoint must be .safetensors, got {flow_checkpoint}")
            try:
                flow.load_state_dict(load_file(str(flow_checkpoint)), strict=True)
            except RuntimeError as exc:
                raise ValueError(
                    f"flow checkpoint {flow_checkpoint} does not match the config: {exc}"
                ) from None
        generator = build_generator(cfg.bigvgan, checkpoint=bigvgan_checkpoint, seed=seed)
        voices = VoiceLibrary(voices_dir if voices_dir is not None else DEFAULT_VOICES_DIR)
        return cls(cfg, flow, generator, voices, device=device, dtype=torch_dtype)

    # ---------------------------------------------------------------- sessions

    def open(self, voice: str = "default", *, seed: int = 0) -> VocoderSession:
        """Start a stream conditioned on `voice`; noise is a function of (seed, frame) only."""
        return self.open_many([(voice, seed)])[0]

    def open_many(self, specs: Sequence[tuple[str, int]]) -> list[VocoderSession]:
        """Batched `open` for (voice, seed) pairs (extension of the contract): one priming forward."""
        voices = [self.voices.get(name) for name, _ in specs]
        for _, seed in specs:
            check_seed(seed)
        sessions = []
        with torch.inference_mode():
            for v, (_, seed) in zip(voices, specs):
                p = v.num_prompt_codes
                mel_start = max(0, _F * p - self.left_context)
                emb = v.speaker_embedding[None].to(self.device, self.dtype)
                sessions.append(
                    VocoderSession(
                        voice=v,
                        seed=seed,
                        slot=self.pool.allocate(),
                        speaker=self.flow.speaker_condition(emb)[0],
                        codes=[int(c) for c in v.prompt_codes.tolist()],
                        codes_start=0,
                        num_codes=p,
                        flow_cursor=0,
                        mel=self._prompt_mel(v)[:, mel_start:],
                        mel_start=mel_start,
                        emitted_frames=_F * p,
                    )
                )
            # Prime the flow over the prompt now, so later steps carry only new frames.
            targets = [max(0, s.num_prompt_codes - LOOKAHEAD_CODES) for s in sessions]
            self._advance_flow(sessions, targets)
        return sessions

    def push(self, session: VocoderSession, codes: Sequence[int]) -> np.ndarray:
        """Add codes; return the PCM that became final (float32, may be empty)."""
        return self.step([(session, codes)])[0]

    def finish(self, session: VocoderSession) -> np.ndarray:
        """Flush the rest of the stream and close the session."""
        return self.finish_many([session])[0]

    def finish_many(self, sessions: Sequence[VocoderSession]) -> list[np.ndarray]:
        """Batched `finish` (extension of the contract)."""
        self._check_sessions(sessions)
        out = self._run(list(sessions), finishing=True)
        for s in sessions:
            self.close(s)
        return out

    def close(self, session: VocoderSession) -> None:
        """Drop a session without producing more audio (abort); idempotent."""
        if not session.is_closed:
            session.is_closed = True
            self.pool.release(session.slot)

    @property
    def num_open_sessions(self) -> int:
        """Sessions opened and not yet finished or closed."""
        return self.pool.num_used

    def step(self, work: list[tuple[VocoderSession, Sequence[int]]]) -> list[np.ndarray]:
        """Push codes to several sessions and run them as one batch; PCM per work item, in order."""
        self._check_sessions([s for s, _ in work])
        checked = [check_codes(codes) for _, codes in work]  # validate all before mutating any
        for (session, _), codes in zip(work, checked):
            session.codes.extend(codes)
            session.num_codes += len(codes)
        return self._run([s for s, _ in work], finishing=False)

    def decode_whole(self, voice: str, codes: Sequence[int], *, seed: int = 0) -> np.ndarray:
        """Reference: the whole utterance in one pass (no caches, no windows)."""
        v = self.voices.get(voice)
        check_seed(seed)
        gen = check_codes(codes)
        if not gen:
            return _EMPTY.copy()
        p = v.num_prompt_codes
        all_codes = torch.tensor(
            [v.prompt_codes.tolist() + gen], dtype=torch.long, device=self.device
        )  # [1, N]
        n = all_codes.shape[1]
        with torch.inference_mode():
            mu = self.flow.encoder(all_codes, torch.tensor([n], device=self.device))  # [1, 80, 4N]
            speaker = self.flow.speaker_condition(v.speaker_embedding[None].to(self.device, self.dtype))
            cond = torch.zeros_like(mu)
            cond[0, :, : _F * p] = self._prompt_mel(v).to(mu.dtype)
            noise = frame_noise(seed, 0, _F * n, device=self.device)[None]
            mel, _ = self.flow.solve(mu, speaker, cond, noise)
            full_mel = torch.cat([self._prompt_mel(v).to(mel.dtype), mel[0, :, _F * p :]], dim=1)[None]
            wav = vocode(self.generator, full_mel)[0, _F * p * HOP_LENGTH :]
        return wav.float().cpu().numpy()

    # ---------------------------------------------------------------- internals

    def _check_sessions(self, sessions: Iterable[VocoderSession]) -> None:
        seen: set[int] = set()
        for s in sessions:
            if not isinstance(s, VocoderSession):
                raise TypeError(f"expected a VocoderSession, got {type(s).__name__}")
            if s.is_closed:
                raise ValueError("session is closed (finished or aborted)")
            if id(s) in seen:
                raise ValueError("the same session appears twice in one step")
            seen.add(id(s))

    def _prompt_mel(self, voice: Voice) -> torch.Tensor:
        if (
            voice.name not in self._voice_mel
            or self._voice_mel[voice.name].shape[1] != voice.prompt_mel.shape[0]
        ):
            self._voice_mel[voice.name] = voice.prompt_mel.T.contiguous().to(
                self.device, torch.float32
            )  # [80, 4P]
        return self._voice_mel[voice.name]

    def _emit_target(self, s: VocoderSession, finishing: bool) -> int:
        """Absolute frame up to which this step would emit PCM (== emitted_frames: nothing)."""
        if finishing:
            return _F * s.num_codes
        final_frames = _F * max(0, s.num_codes - LOOKAHEAD_CODES)
        target = final_frames - self.right_context
        need = (
            self.config.stream.first_chunk_codes
            if s.is_first_chunk_pending
            else self.config.stream.chunk_codes
        )
        return target if target - s.emitted_frames >= _F * need else s.emitted_frames

    def _run(self, sessions: list[VocoderSession], finishing: bool) -> list[np.ndarray]:
        targets = [self._emit_target(s, finishing) for s in sessions]
        ready = [i for i, (s, t) in enumerate(zip(sessions, targets)) if t > s.emitted_frames]
        out = [_EMPTY] * len(sessions)
        if not ready:
            return out
        with torch.inference_mode():
            flow_targets = [
                sessions[i].num_codes if finishing else sessions[i].num_codes - LOOKAHEAD_CODES for i in ready
            ]
            self._advance_flow([sessions[i] for i in ready], flow_targets)
            pcm = self._vocode([sessions[i] for i in ready], [targets[i] for i in ready], finishing)
        for i, wav in zip(ready, pcm):
            out[i] = wav
        return out

    def _advance_flow(self, sessions: list[VocoderSession], targets: list[int]) -> None:
        """Encoder + Euler integration for code positions [flow_cursor, target) of each session, batched."""
        work = [(s, t) for s, t in zip(sessions, targets) if t > s.flow_cursor]
        if not work:
            return
        starts = [max(s.codes_start, s.flow_cursor - self.history_codes) for s, _ in work]
        windows = [s.codes[w - s.codes_start :] for (s, _), w in zip(work, starts)]
        n_max = max(len(w) for w in windows)
        codes = torch.zeros(len(work), n_max, dtype=torch.long)
        for row, w in enumerate(windows):
            codes[row, : len(w)] = torch.tensor(w, dtype=torch.long)
        num_valid = torch.tensor([len(w) for w in windows], device=self.device)
        mu_all = self.flow.encoder(codes.to(self.device), num_valid)  # [B, 80, 4 * n_max]

        new_frames = [_F * (t - s.flow_cursor) for s, t in work]
        t_max = max(new_frames)
        # Row b's new frames sit at mu_all[b, :, 4 * (cursor_b - start_b) + j]; padding rows repeat the last.
        offsets = torch.tensor(
            [_F * (s.flow_cursor - w) for (s, _), w in zip(work, starts)], device=self.device
        )
        idx = (offsets[:, None] + torch.arange(t_max, device=self.device)).clamp(max=mu_all.shape[2] - 1)
        mu = torch.gather(mu_all, 2, idx[:, None, :].expand(-1, mu_all.shape[1], -1))  # [B, 80, T]
        cond = torch.zeros_like(mu)
        for row, (s, t) in enumerate(work):  # only sessions still inside their prompt (priming)
            f0, prompt_frames = _F * s.flow_cursor, _F * s.num_prompt_codes
            if f0 < prompt_frames:
                end = min(_F * t, prompt_frames)
                cond[row, :, : end - f0] = self._prompt_mel(s.voice)[:, f0:end].to(cond.dtype)
        seeds = [s.seed for s, _ in work]
        noise = batch_frame_noise(seeds, [_F * s.flow_cursor for s, _ in work], t_max, device=self.device)
        speaker = torch.stack([s.speaker for s, _ in work])  # [B, 80]
        slots = torch.tensor([s.slot for s, _ in work], device=self.device)
        valid = torch.tensor(new_frames, device=self.device)
        caches = [self.pool.read(slots, k) for k in range(self.config.flow.num_steps)]
        mel, new_caches = self.flow.solve(mu, speaker, cond, noise, caches, valid)  # [B, 80, T]
        for k, step_caches in enumerate(new_caches):
            self.pool.write(slots, k, step_caches)

        for row, (s, t) in enumerate(work):
            f0, f1 = _F * s.flow_cursor, _F * t
            first_gen = max(f0, _F * s.num_prompt_codes)  # prompt frames keep the real prompt mel
            if f1 > first_gen:
                assert s.mel_end == first_gen, (s.mel_end, first_gen)
                s.mel = torch.cat([s.mel, mel[row, :, first_gen - f0 : f1 - f0].float()], dim=1)
            s.flow_cursor = t
            keep_from = max(s.codes_start, t - self.history_codes)
            s.codes = s.codes[keep_from - s.codes_start :]
            s.codes_start = keep_from

    def _vocode(
        self, sessions: list[VocoderSession], targets: list[int], finishing: bool
    ) -> list[np.ndarray]:
        """BigVGAN over [emitted - left, target + right) per session; returns the final samples only."""
        windows = []
        for s, target in zip(sessions, targets):
            start = max(s.mel_start, s.emitted_frames - self.left_context)
            stop = s.mel_end if finishing else min(s.mel_end, target + self.right_context)
            assert stop >= target, (stop, target)
            windows.append((start, stop))
        # Right-padding is harmless when a window ends `right_context` frames past its target; a window
        # ending at the true end of a stream must not be padded, so finishing windows run per length.
        if finishing:
            groups: dict[int, list[int]] = {}
            for i, (a, z) in enumerate(windows):
                groups.setdefault(z - a, []).append(i)
            batches = list(groups.values())
        else:
            batches = [list(range(len(sessions)))]
        out: list[np.ndarray] = [_EMPTY] * len(sessions)
        for batch in batches:
            t_max = max(windows[i][1] - windows[i][0] for i in batch)
            mel = torch.zeros(len(batch), sessions[0].mel.shape[0], t_max, device=self.device)  # [B, 80, T]
            for row, i in enumerate(batch):
                s, (a, z) = sessions[i], windows[i]
                mel[row, :, : z - a] = s.mel[:, a - s.mel_start : z - s.mel_start]
            wav = vocode(self.generator, mel).float().cpu().numpy()  # [B, T * 480], one transfer
            for row, i in enumerate(batch):
                s, (a, _) = sessions[i], windows[i]
                lo, hi = (s.emitted_frames - a) * HOP_LENGTH, (targets[i] - a) * HOP_LENGTH
                out[i] = wav[row, lo:hi].copy()
        for s, target in zip(sessions, targets):
            s.num_samples_emitted += (target - s.emitted_frames) * HOP_LENGTH
            s.emitted_frames = target
            keep_from = max(s.mel_start, target - self.left_context)
            s.mel = s.mel[:, keep_from - s.mel_start :]
            s.mel_start = keep_from
        return out


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
    return names[dtype]
