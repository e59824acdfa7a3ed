"""`build_app(args)`: the one entry point shared by `config/*.yaml` (`import_path`) and Python code.

    ingress (HTTP) --one stream per utterance--> VocoderServer --one stream--> LLMServer (Engine)

Each deployment states its own options from `AppArgs`; every one gets a fractional `num_cpus`.
"""
from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from deployments.args import AppArgs, split_options
from deployments.ingress import Ingress
from deployments.llm_server import LLMServer
from deployments.vocoder_server import VocoderServer


class GpuUnavailableError(RuntimeError):
    """GPUs were asked for but the cluster has none (Serve would otherwise hang in DEPLOYING)."""


def available_gpus() -> float:
    """GPUs the Ray cluster reports (when connected), else the GPUs torch sees on this machine."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0.0))
    import torch

    return float(torch.cuda.device_count())


def check_gpus(args: AppArgs, gpus_available: float | None = None) -> None:
    """Raise `GpuUnavailableError` / ValueError for GPU settings that could never start."""
    llm_gpus = float(args.llm_options.get("num_gpus") or 0)
    vocoder_gpus = float(args.vocoder_options.get("num_gpus") or 0)
    if float(args.ingress_options.get("num_gpus") or 0) > 0:
        raise ValueError("ingress_options.num_gpus must be 0: the ingress runs no model")
    engine_device = str(args.engine.get("device", "cpu"))
    for name, device, gpus in (("engine", engine_device, llm_gpus), ("vocoder", args.vocoder_device,
                                                                     vocoder_gpus)):
        options = "llm_options" if name == "engine" else "vocoder_options"
        if device.startswith("cuda") and gpus <= 0:
            raise ValueError(f"{name} device is {device!r} but {options}.num_gpus is 0: "
                             f"give the deployment a GPU share (e.g. 0.8) or use device 'cpu'")
        if not device.startswith("cuda") and gpus > 0:
            raise ValueError(f"{options}.num_gpus is {gpus} but the {name} device is {device!r}: "
                             f"set device 'cuda' or num_gpus 0")
    needed = llm_gpus + vocoder_gpus  # one replica of each must fit
    if needed <= 0 or not args.require_gpus_at_start:
        return
    available = available_gpus() if gpus_available is None else gpus_available
    if available < needed:
        raise GpuUnavailableError(
            f"this config asks for GPUs (LLM num_gpus={llm_gpus}, vocoder num_gpus={vocoder_gpus}) but the "
            f"Ray cluster has {available:g} GPU(s). Replicas would wait in DEPLOYING forever. Use "
            f"config/serve.yaml (CPU, tiny models) on this machine, or set require_gpus_at_start: false "
            f"if GPU nodes join the cluster later.")


def _deployment_kwargs(options: dict[str, Any], args: AppArgs) -> dict[str, Any]:
    """`@serve.deployment` kwargs of one deployment. A stopping replica (scale-down, new version) drains for
    `request_timeout_s` unless the options say otherwise: no request lives longer, so none in flight is cut
    (Ray's default, 20 s, cut utterances of a minute; an idle replica stops at once either way)."""
    deployment, actor = split_options(options)
    return {"graceful_shutdown_timeout_s": args.request_timeout_s, **deployment, "ray_actor_options": actor}


def build_app(args: dict[str, Any] | AppArgs) -> Application:
    """Build the three-deployment app from `AppArgs` (or its dict form, as in YAML `args:`)."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    check_gpus(args)
    llm = serve.deployment(LLMServer).options(name="LLMServer", **_deployment_kwargs(args.llm_options, args))
    vocoder = serve.deployment(VocoderServer).options(name="VocoderServer",
                                                      **_deployment_kwargs(args.vocoder_options, args))
    ingress = serve.deployment(Ingress).options(name="Ingress", **_deployment_kwargs(args.ingress_options, args))
    vocoder_kwargs = {"preset": args.vocoder_preset, "device": args.vocoder_device,
                      "dtype": args.vocoder_dtype, "seed": args.vocoder_seed,
                      "cuda_graphs": args.vocoder_cuda_graphs, "bucket_shapes": args.vocoder_bucket_shapes,
                      "warmup_rows": args.vocoder_warmup_rows,
                      "graphs_after_warmup": args.vocoder_graphs_after_warmup,
                      "eager_warmup_rows": args.vocoder_eager_warmup_rows,
                      "reserved_sessions": args.vocoder_reserved_sessions,
                      "chunk_schedule_codes": args.vocoder_chunk_schedule_codes,
                      "light_load_schedule_codes": args.vocoder_light_load_schedule_codes,
                      "light_load_max_sessions": args.vocoder_light_load_max_sessions,
                      "triton_kernels": args.vocoder_triton_kernels,
                      "fast_lane_code_budget": args.vocoder_fast_lane_code_budget,
                      "memory_cap_bytes": args.vocoder_memory_cap_bytes,
                      "check_matmuls": args.vocoder_check_matmuls}
    llm_app = llm.bind(dict(args.engine))
    streaming = {"codes_batch_s": args.codes_batch_s, "policy": args.vocoder_batching,
                 "urgent_buffer_s": args.vocoder_urgent_buffer_s,
                 "step_code_budget": args.vocoder_step_code_budget,
                 "urgent_step_code_budget": args.vocoder_urgent_step_code_budget,
                 "fast_lane_code_budget": args.vocoder_fast_lane_code_budget,
                 "background_yield": args.vocoder_background_yield,
                 "yield_max_s": args.vocoder_yield_max_s}
    vocoder_app = vocoder.bind(vocoder_kwargs, args.vocoder_max_batch_size, llm_app, streaming,
                               call_timeout_s=args.vocoder_call_timeout_s, retry_after_s=args.retry_after_s,
                               speech_encoder=args.speech_encoder)
    return ingress.bind(args.model_dump(), llm_app, vocoder_app)
