"""Command line: one prompt through the engine, e.g.

    python -m runtime.generate --model tiny --text "Hello" --max-new-tokens 16 --json

Prints one JSON object (with --json) holding the text, the audio codes, the finish reason and
timings taken from the engine's own step timings: `prefill_ms` is the wall time of the steps that
ran the prompt, `decode_ms_per_step` the mean wall time of the steps that ran one generated row.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence as Seq
from typing import Any

import torch

from runtime.engine import EngineConfig, EngineCore
from runtime.errors import EngineError
from runtime.prompts import ChatMessage, build_prompt_rows
from runtime.request import AudioCodes, Finished, GenerationRequest, TextDelta
from runtime.sampling import SamplingParams


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    """The command line options."""
    parser = argparse.ArgumentParser(prog="python -m runtime.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="preset (tiny, full: random weights) or checkpoint folder")
    parser.add_argument("--text", required=True, help="the user message")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-new-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.6, help="both channels; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--repetition-penalty", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output-modality", default="audio", choices=["audio", "text"])
    parser.add_argument("--fast-path", action="store_true",
                        help="fused weights, Triton kernels and decode CUDA graphs on cuda (docs/gpu.md)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        kind = torch.device(args.device).type
    except RuntimeError as exc:
        parser.error(f"--device: {exc}")  # exit 2, as for any other bad option
    if kind not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine's PyTorch sees no CUDA device")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, generate, and return the result fields."""
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_running=1,
                          fast_path=args.fast_path)
    core = EngineCore.from_config(config)  # one request: the synchronous core, no event loop needed
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.repetition_penalty)
    rows = build_prompt_rows(core.tokenizer, [ChatMessage("user", args.text)], output_modality=args.output_modality)
    request = GenerationRequest(
        "cli", tuple(rows), params, params, max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens, seed=args.seed,
    )
    seq = core.add_request(request)
    text: list[str] = []
    codes: list[int] = []
    finished: Finished | None = None
    while finished is None:
        for _, event in core.step():
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, AudioCodes):
                codes.extend(event.codes)
            elif isinstance(event, Finished):
                finished = event
    return {
        "text": "".join(text),
        "num_audio_codes": len(codes),
        "audio_codes": codes,
        "finish_reason": finished.reason,
        "error": finished.error,
        "num_prompt_tokens": finished.num_prompt_tokens,
        "num_generated_tokens": finished.num_generated_tokens,
        "prefill_ms": seq.prefill_s * 1e3,
        "decode_ms_per_step": seq.decode_s * 1e3 / seq.num_decode_steps if seq.num_decode_steps else 0.0,
        "num_decode_steps": seq.num_decode_steps,
        "model": args.model,
        "device": args.device,
    }


def main(argv: Seq[str] | None = None) -> int:
    """Entry point: exit code 0 when the generation ended normally, 2 for a rejected request or model (bad
    options, a checkpoint that does not load), 1 when the generation itself ended with an error (the
    result is printed first)."""
    args = parse_args(argv)
    try:
        result = run(args)
    except (EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
        print(
            f"[{result['finish_reason']}] {result['num_generated_tokens']} rows, {result['num_audio_codes']} audio "
            f"codes, prefill {result['prefill_ms']:.1f} ms, decode {result['decode_ms_per_step']:.1f} ms/step",
            file=sys.stderr,
        )
    if result["finish_reason"] == "error":
        print(f"error: generation failed: {result['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
