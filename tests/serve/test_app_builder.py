"""`build_app` and the shipped YAML configs (no cluster needed)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.build_app import build_app as serve_build_app
from ray.serve.schema import ServeDeploySchema

from deployments.app import GpuUnavailableError, build_app, check_gpus
from deployments.args import AppArgs

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"


def yaml_args(name: str) -> dict:
    config = yaml.safe_load((CONFIG_DIR / name).read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    return app["args"]


def deployments_of(args: dict) -> dict:
    built = serve_build_app(build_app(args), name="test")
    return {d.name: d for d in built.deployments}


def test_cpu_config_builds_three_deployments_with_fractional_cpus_and_no_gpus() -> None:
    deployments = deployments_of(yaml_args("serve.yaml"))
    assert set(deployments) == {"LLMServer", "VocoderServer", "Ingress"}
    options = {name: d.ray_actor_options for name, d in deployments.items()}
    assert options == {"LLMServer": {"num_cpus": 0.5}, "VocoderServer": {"num_cpus": 0.5},
                       "Ingress": {"num_cpus": 0.25}}


def test_replicas_drain_for_the_request_timeout_unless_told_otherwise() -> None:
    """A stopping replica waits for its requests up to `request_timeout_s` (Ray's default, 20 s, cut long
    utterances on every scale-down); a deployment's own `graceful_shutdown_timeout_s` wins."""
    args = yaml_args("serve.yaml") | {"request_timeout_s": 300.0}
    args["vocoder_options"] = {**args.get("vocoder_options", {}), "graceful_shutdown_timeout_s": 45.0}
    drains = {name: d._deployment_config.graceful_shutdown_timeout_s for name, d in deployments_of(args).items()}
    assert drains == {"LLMServer": 300.0, "VocoderServer": 45.0, "Ingress": 300.0}


@pytest.mark.parametrize("name", ["serve-4090.yaml", "serve-4090-fp8.yaml"])
def test_gpu_config_is_refused_on_a_gpu_less_cluster(name: str) -> None:
    args = AppArgs.model_validate(yaml_args(name))
    with pytest.raises(GpuUnavailableError, match=r"LLM num_gpus=0.8, vocoder num_gpus=0.2\) but the "
                                                  r"Ray cluster has 0 GPU\(s\)"):
        check_gpus(args, gpus_available=0.0)
    check_gpus(args, gpus_available=1.0)  # one card holds 0.8 + 0.2


@pytest.mark.parametrize(("name", "fp8_scope", "step_tokens", "caps_gib", "eager_rows", "speech_encoder",
                          "captured_rows"), [
    ("serve-4090.yaml", None, 512, (19.75, 2.25), [], "none", 2),
    ("serve-4090-fp8.yaml", "all", 1024, (15.0, 5.0), [], "full", 8)])
def test_24gb_configs_cap_both_replicas_and_freeze_the_vocoder_graphs(
        name: str, fp8_scope: str | None, step_tokens: int, caps_gib: tuple[float, float],
        eager_rows: list[int], speech_encoder: str, captured_rows: int) -> None:
    # measured under these caps on an H200: bench/results/serve-4090-on-h200/, (the bf16 config's 512
    # tokens per step, after 1024 ran out of memory in a burst) bench/results/serve-4090-kv8/ and (the FP8
    # config's caps with the speech encoder on the vocoder replica) bench/results/serve-4090-fp8-speech/
    from runtime.engine import EngineConfig

    args = AppArgs.model_validate(yaml_args(name))
    engine = EngineConfig(**args.engine)
    assert (engine.fast_path, engine.fp8_scope, engine.max_num_batched_tokens) == (True, fp8_scope, step_tokens)
    assert (engine.kv_cache_dtype, engine.check_largest_step) == ("auto", None)  # the check runs on CUDA
    assert (engine.memory_cap_bytes / 2**30, args.vocoder_memory_cap_bytes / 2**30) == caps_gib
    assert args.vocoder_cuda_graphs and args.vocoder_bucket_shapes and not args.vocoder_graphs_after_warmup
    assert args.vocoder_eager_warmup_rows == eager_rows
    assert args.speech_encoder == speech_encoder  # the bf16 config has no room for the encoder
    # no vocoder step outgrows the graphs captured at start (eager steps of more rows took 0.2-1.9 s under
    # load: bench/results/serve-4090-vocoder-cap-h200/)
    assert args.vocoder_max_batch_size == max(args.vocoder_warmup_rows) == captured_rows


@pytest.mark.parametrize("source", ["serve-4090.yaml", "k8s"])
def test_two_row_vocoders_scale_up_on_lag_and_down_on_their_busy_fraction(source: str) -> None:
    """At a cap of 2 rows a serving replica's occupancy is 0.5 (one stream a step) or 1.0: the policy must not
    call full steps hot, and (with 0.5 as its low mark, until the fifty-first session) it could never call a
    fleet with traffic on every replica quiet, so the k8s fleet kept up to 4 GPU workers' vocoders. Lag alone
    would call any fleet quiet that keeps up, however loaded: the busy fraction, projected onto one replica
    fewer, must stay under half."""
    from deployments.autoscaling import VocoderPolicy

    if source == "k8s":
        manifest = yaml.safe_load((CONFIG_DIR.parent / "k8s" / "rayservice.yaml").read_text())
        args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    else:
        args = yaml_args(source)
    assert args["vocoder_max_batch_size"] == 2
    policy = VocoderPolicy(**args["vocoder_options"]["autoscaling_config"]["policy"]["policy_kwargs"])
    full = {"batch_occupancy": {"r1": 1.0}, "busy_fraction": {"r1": 1.0}, "lag_s": {"r1": 0.0}}
    assert policy.classify(full) == ("hold", "between thresholds")  # not hot: it keeps up
    assert policy.classify(full | {"lag_s": {"r1": 0.6}}) == ("hot", "lag_s 0.6 > 0.5")
    light = {"batch_occupancy": dict.fromkeys("abcd", 1.0), "busy_fraction": dict.fromkeys("abcd", 0.36),
             "lag_s": dict.fromkeys("abcd", 0.05)}
    assert policy.classify(light) == ("quiet", "all signals below low thresholds")  # 0.36 x 4/3 = 0.48
    assert policy.classify(light | {"busy_fraction": dict.fromkeys("abcd", 0.4)}) == ("hold", "between thresholds")
    assert policy.classify(light | {"lag_s": dict.fromkeys("abcd", 0.2)}) == ("hold", "between thresholds")
    with pytest.raises(ValueError, match="^batch_occupancy: its high and low marks are both numbers or both None"):
        VocoderPolicy(occupancy_high=None)
    with pytest.raises(ValueError, match="^busy_fraction: its high and low marks"):
        VocoderPolicy(busy_low=0.5)


def test_the_vocoder_call_timeout_and_retry_after_reach_the_vocoder_replica() -> None:
    """`vocoder_call_timeout_s` becomes VocoderServer's `call_timeout_s` (its health check), `retry_after_s`
    its own (the 503 it yields when the LLM deployment is over capacity), `speech_encoder` the encoder it builds."""
    args = yaml_args("serve.yaml")
    default = deployments_of(args)["VocoderServer"]
    assert default.init_kwargs == {"call_timeout_s": 60.0, "retry_after_s": 1.0, "speech_encoder": "tiny"}
    tuned = deployments_of(args | {"vocoder_call_timeout_s": 7.5, "retry_after_s": 4.0,
                                   "speech_encoder": "/models/codec-encoder"})["VocoderServer"]
    assert tuned.init_kwargs == {"call_timeout_s": 7.5, "retry_after_s": 4.0,
                                 "speech_encoder": "/models/codec-encoder"}


def test_deployment_options_given_replace_the_defaults_one_by_one() -> None:
    """`llm_options: {env_vars: ...}` alone (as docs/operations.md shows) keeps the other defaults: the LLM
    replica still takes 256 requests at once, not Serve's 5."""
    args = AppArgs.model_validate({"llm_options": {"env_vars": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "90"}},
                                   "ingress_options": {"max_ongoing_requests": 64}})
    assert args.llm_options == {"num_cpus": 0.5, "num_gpus": 0, "max_ongoing_requests": 256,
                                "env_vars": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "90"}}
    assert args.ingress_options == {"num_cpus": 0.25, "max_ongoing_requests": 64}
    llm = deployments_of(args.model_dump())["LLMServer"]
    assert llm.max_ongoing_requests == 256 and llm.ray_actor_options["num_cpus"] == 0.5


def test_gpu_config_uses_the_ops_autoscaling_policies() -> None:
    args = yaml_args("serve-4090.yaml")
    args["require_gpus_at_start"] = False
    deployments = deployments_of(args)
    llm, vocoder = deployments["LLMServer"], deployments["VocoderServer"]
    assert llm.ray_actor_options == {"num_gpus": 0.8, "num_cpus": 2}
    assert vocoder.ray_actor_options == {"num_gpus": 0.2, "num_cpus": 1}
    assert llm._deployment_config.autoscaling_config.policy.policy_function == \
        "deployments.autoscaling:llm_policy"
    assert vocoder._deployment_config.autoscaling_config.policy.policy_function == \
        "deployments.autoscaling:vocoder_policy"


def test_env_vars_reach_the_replica_process_through_its_runtime_env() -> None:
    args = yaml_args("serve.yaml")
    args["llm_options"] = {**args["llm_options"], "env_vars": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}}
    deployments = deployments_of(args)
    assert deployments["LLMServer"].ray_actor_options == {
        "num_cpus": 0.5, "runtime_env": {"env_vars": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}}}
    assert deployments["VocoderServer"].ray_actor_options == {"num_cpus": 0.5}


def test_custom_resources_reach_the_replicas_actor_options() -> None:
    args = yaml_args("serve.yaml")
    args["vocoder_options"] = {**args["vocoder_options"], "resources": {"vocoder_slot": 1}}
    assert deployments_of(args)["VocoderServer"].ray_actor_options == {"num_cpus": 0.5,
                                                                       "resources": {"vocoder_slot": 1}}


@pytest.mark.parametrize(("change", "message"), [
    ({"engine": {"model": "tiny", "device": "cuda"}}, "engine device is 'cuda' but llm_options.num_gpus is 0"),
    ({"vocoder_options": {"num_gpus": 0.5}}, "vocoder_options.num_gpus is 0.5 but the vocoder device is 'cpu'"),
    ({"ingress_options": {"num_gpus": 1}}, "ingress_options.num_gpus must be 0"),
])
def test_inconsistent_gpu_settings_fail_at_build_time(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_gpus(AppArgs.model_validate(change), gpus_available=8.0)


@pytest.mark.parametrize(("args", "fragment"), [
    ({"llm_options": {"num_cpu": 1}}, "unknown deployment option(s) ['num_cpu']"),
    ({"llm_options": {"num_cpus": -1}}, "num_cpus must be a finite number >= 0"),
    ({"llm_options": {"env_vars": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": 50}}},
     "env_vars must map variable names to strings"),
    ({"vocoder_options": {"env_vars": ["A=1"]}}, "env_vars must map variable names to strings"),
    ({"vocoder_options": {"resources": {"vocoder_slot": 0}}}, "resources must map custom resource names"),
    ({"vocoder_options": {"resources": {"GPU": 1}}}, "(not CPU, GPU or memory) to amounts > 0"),
    ({"vocoder_options": {"resources": ["vocoder_slot"]}}, "resources must map custom resource names"),
    ({"engine": {"device": "cpu"}}, "engine.model is required"),
    ({"vocoder_preset": "huge"}, "'tiny' or 'full'"),
    ({"unknown_knob": 1}, "Extra inputs are not permitted"),
    ({"vocoder_warmup_rows": [1, 4]}, "vocoder_warmup_rows need vocoder_cuda_graphs: true"),
    ({"vocoder_bucket_shapes": True}, "vocoder_bucket_shapes and vocoder_warmup_rows need"),
    ({"vocoder_cuda_graphs": True, "vocoder_warmup_rows": [0]}, "vocoder_warmup_rows must all be >= 1"),
    ({"vocoder_cuda_graphs": True, "vocoder_graphs_after_warmup": False},
     "vocoder_graphs_after_warmup: false needs vocoder_warmup_rows"),
    ({"vocoder_cuda_graphs": True, "vocoder_warmup_rows": [1], "vocoder_eager_warmup_rows": [4]},
     "vocoder_eager_warmup_rows needs vocoder_graphs_after_warmup: false"),
    ({"vocoder_eager_warmup_rows": [4, 0]}, "vocoder_eager_warmup_rows must all be >= 1"),
    ({"vocoder_cuda_graphs": True, "vocoder_warmup_rows": [1, 2], "vocoder_graphs_after_warmup": False,
      "vocoder_eager_warmup_rows": [4], "vocoder_max_batch_size": 2},
     "vocoder_eager_warmup_rows [4]: no vocoder step has more than 2 rows"),
    ({"vocoder_cuda_graphs": True, "vocoder_warmup_rows": [1, 16], "vocoder_max_batch_size": 8},
     "vocoder_warmup_rows [16]: no vocoder step has more than 8 rows"),
    ({"vocoder_cuda_graphs": True, "vocoder_bucket_shapes": True, "vocoder_warmup_rows": [1, 8],
      "vocoder_max_batch_size": 3}, "vocoder_warmup_rows [8]: no vocoder step has more than 4 rows"),
    ({"vocoder_reserved_sessions": -1}, "greater than or equal to 0"),
    ({"vocoder_chunk_schedule_codes": [3, 0]},
     "vocoder_chunk_schedule_codes must be a non-empty sequence of integer sizes >= 1, got (3, 0)"),
    ({"vocoder_light_load_schedule_codes": []},
     "vocoder_light_load_schedule_codes must be a non-empty sequence of integer sizes >= 1, got ()"),
    # accepted here until the fifty-first session, then refused by the vocoder replica at start-up
    ({"vocoder_chunk_schedule_codes": [1, 2]},
     "vocoder_chunk_schedule_codes (1, 2): overlap_samples (1920) must be shorter than its smallest chunk"),
    ({"vocoder_dtype": "bf16"}, "Input should be 'bfloat16', 'float16' or 'float32'"),
    ({"vocoder_device": "gpu"}, "vocoder_device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ({"engine": {"model": "tiny", "device": "mps"}}, "engine.device must be 'cpu', 'cuda' or 'cuda:N', got 'mps'"),
    # no NaN, infinity, bool for an int or string for a number, here or in the engine's settings
    ({"codes_batch_s": float("inf")}, "Input should be a finite number"),
    ({"retry_after_s": float("nan")}, "Input should be a finite number"),
    ({"vocoder_max_batch_size": True}, "Input should be a valid integer"),
    ({"max_input_chars": "4096"}, "Input should be a valid integer"),
    ({"llm_options": {"num_gpus": float("nan")}}, "num_gpus must be a finite number >= 0, got nan"),
    ({"llm_options": {"num_cpus": True}}, "num_cpus must be a finite number >= 0, got True"),
    ({"engine": {"model": "tiny", "max_num_running": float("nan")}}, "engine: max_num_running must be an integer"),
    ({"engine": {"model": "tiny", "step_timeout_s": float("inf")}}, "engine: step_timeout_s must be a finite number"),
    ({"engine": {"model": "tiny", "block_size": "16"}}, "engine: block_size must be an integer, got '16'"),
    ({"codes_batch_s": 60.0}, "codes_batch_s (60.0) must be below stream_idle_timeout_s (60.0)"),
    ({"vocoder_light_load_max_sessions": 0}, "greater than or equal to 1"),
    ({"vocoder_step_code_budget": 128, "vocoder_urgent_step_code_budget": 64},
     "vocoder_urgent_step_code_budget (64) must be at least vocoder_step_code_budget (128)"),
    ({"vocoder_fast_lane_code_budget": 32, "vocoder_batching": "fifo"},
     "vocoder_fast_lane_code_budget needs vocoder_batching: deadline"),
    ({"vocoder_fast_lane_code_budget": 0}, "greater than or equal to 1"),
    ({"vocoder_background_yield": "first_chunk"}, "vocoder_background_yield needs vocoder_fast_lane_code_budget"),
    ({"vocoder_background_yield": "always", "vocoder_fast_lane_code_budget": 32},
     "Input should be 'off', 'first_chunk' or 'newcomer'"),
    ({"vocoder_yield_max_s": 0}, "greater than 0"),
    ({"vocoder_call_timeout_s": 0}, "greater than 0"),
    # the engine's settings are EngineConfig's, checked at build time instead of failing every replica
    ({"engine": {"model": "tiny", "max_model_length": 8192}},
     "engine: got an unexpected keyword argument 'max_model_length'"),
    ({"engine": {"model": "tiny", "dtype": "bf16"}}, "dtype must be one of ['bfloat16', 'float16', 'float32']"),
    ({"default_max_new_tokens": 1024, "max_new_tokens_limit": 100},
     "default_max_new_tokens (1024) must not exceed max_new_tokens_limit (100)"),
    ({"vocoder_memory_cap_bytes": 2**30}, "vocoder_memory_cap_bytes needs vocoder_device cuda, got 'cpu'"),
    ({"vocoder_memory_cap_bytes": 0, "vocoder_device": "cuda"}, "greater than or equal to 1"),
])
def test_bad_app_args_are_rejected(args: dict, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate(args)
    assert fragment in str(info.value)
