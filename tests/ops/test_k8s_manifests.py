"""k8s/ manifests checked offline: the RayService against KubeRay's CRD schema, the embedded Serve
config against Ray's and our own models, and the monitoring manifests for the fields they need."""
from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from deployments.autoscaling import LLMPolicy, VocoderPolicy

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
# CI keeps shared/ beside the clone; a device checkout may hold it inside.
CRD_DIRS = [REPO.parent / "shared" / "k8s-crds", REPO / "shared" / "k8s-crds"]
CRD_DIR = next((d for d in CRD_DIRS if (d / "ray.io_rayservices.yaml").is_file()), None)
needs_crds = pytest.mark.skipif(CRD_DIR is None, reason=f"KubeRay CRDs not found in {CRD_DIRS}")


def load_yaml(name: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / name).read_text())


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected, as `kubectl apply --validate=strict` does.

    Structural CRD schemas list every known field; the API server prunes (or, strictly, rejects)
    others, while plain JSON Schema would silently accept a misspelt field.
    """
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@functools.cache
def crd_validator(crd_file: str, version: str = "v1") -> jsonschema.Draft7Validator:
    assert CRD_DIR is not None
    # The CRDs are ~18k lines each: parse them once, with libyaml's C loader.
    crd = yaml.load((CRD_DIR / crd_file).read_text(), Loader=yaml.CSafeLoader)
    (schema,) = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(strict(schema))


def errors(validator: jsonschema.Draft7Validator, doc: Any) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc))


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return load_yaml("rayservice.yaml")


@pytest.fixture(scope="module")
def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def containers(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


@needs_crds
def test_rayservice_satisfies_the_kuberay_crd_schema(rayservice: dict[str, Any]) -> None:
    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    assert errors(crd_validator("ray.io_rayservices.yaml"), rayservice) == []


@needs_crds
def test_embedded_cluster_satisfies_the_raycluster_crd_schema(rayservice: dict[str, Any]) -> None:
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "moss-speech"},
               "spec": rayservice["spec"]["rayClusterConfig"]}
    assert errors(crd_validator("ray.io_rayclusters.yaml"), cluster) == []


@needs_crds
def test_strict_validation_rejects_typos_and_missing_required_fields(rayservice: dict[str, Any]) -> None:
    validator = crd_validator("ray.io_rayservices.yaml")
    typo = copy.deepcopy(rayservice)
    typo["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert errors(validator, typo) == [
        ("spec/rayClusterConfig/headGroupSpec: Additional properties are not allowed "
         "('rayStartParam' was unexpected)")]
    missing = copy.deepcopy(rayservice)
    del missing["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"]
    assert errors(validator, missing) == [
        "spec/rayClusterConfig/workerGroupSpecs/0: 'maxReplicas' is a required property"]


def test_serve_config_names_the_app_builder_and_validates_with_ray_and_app_args(
        serve_config: dict[str, Any]) -> None:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": 8000, "request_timeout_s": 900}
    from deployments.args import AppArgs

    AppArgs.model_validate(app["args"])


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "config").glob("*.yaml")))
def test_every_shipped_configs_policy_kwargs_build(name: str) -> None:
    """Each config/*.yaml that names a custom policy: its kwargs build the policy (a misspelt kwarg raises
    TypeError here instead of when Ray builds the policy at deploy time)."""
    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / name).read_text())
    args = config["applications"][0]["args"]
    policies = {"deployments.autoscaling:llm_policy": LLMPolicy, "deployments.autoscaling:vocoder_policy": VocoderPolicy}
    for key in ("llm_options", "vocoder_options", "ingress_options"):
        policy = args.get(key, {}).get("autoscaling_config", {}).get("policy")
        if policy is not None:
            policies[policy["policy_function"]](**policy.get("policy_kwargs", {}))


def test_autoscaling_policies_and_their_kwargs_build(serve_config: dict[str, Any]) -> None:
    from ray.serve.config import AutoscalingConfig

    args = serve_config["applications"][0]["args"]
    expected = {"llm_options": ("deployments.autoscaling:llm_policy", LLMPolicy),
                "vocoder_options": ("deployments.autoscaling:vocoder_policy", VocoderPolicy)}
    for key, (path, cls) in expected.items():
        autoscaling = args[key]["autoscaling_config"]
        AutoscalingConfig(**autoscaling)
        assert autoscaling["policy"]["policy_function"] == path
        cls(**autoscaling["policy"]["policy_kwargs"])  # a misspelt kwarg raises TypeError here
        # The policy owns hysteresis; Ray's own delays would add to it.
        assert (autoscaling["upscale_delay_s"], autoscaling["downscale_delay_s"]) == (0, 0)
        # Ray 2.60's replicas push their stats every metrics_interval_s (default 10 s); the env variable
        # RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S that its deprecation notice names is read by nothing
        assert AutoscalingConfig(**autoscaling).metrics_interval_s == 2


def test_an_upgrade_keeps_the_old_cluster_until_its_longest_request_can_end(rayservice: dict[str, Any],
                                                                           serve_config: dict[str, Any]) -> None:
    request_timeout_s = serve_config["applications"][0]["args"]["request_timeout_s"]
    assert rayservice["spec"]["rayClusterDeletionDelaySeconds"] > request_timeout_s == 600
    # ignored by KubeRay since 1.1 (kuberay#1657): setting them would promise a rebuild that never comes
    assert not {"deploymentUnhealthySecondThreshold", "serviceUnhealthySecondThreshold"} & rayservice["spec"].keys()


def test_gpu_fractions_fit_24gb_workers_at_max_replicas(rayservice: dict[str, Any],
                                                        serve_config: dict[str, Any]) -> None:
    args = serve_config["applications"][0]["args"]
    llm, vocoder = args["llm_options"], args["vocoder_options"]
    assert 0 < llm["num_gpus"] < 1 and 0 < vocoder["num_gpus"] < 1
    assert llm["num_gpus"] + vocoder["num_gpus"] <= 1  # one LLM and one vocoder replica share a card
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (worker,) = group["template"]["spec"]["containers"]
    gpus_per_worker = int(worker["resources"]["limits"]["nvidia.com/gpu"])
    # The total fitting is not enough: two vocoders on one card leave 0.6 GPU, which no LLM replica (0.8) can
    # use. Each worker offers one vocoder_slot and each vocoder replica takes one, so every card holds at most
    # one vocoder and (0.8 + 0.8 > 1) one LLM: a card without an LLM always has room for one, and as many
    # workers as the larger max_replicas place every replica in any order.
    assert gpus_per_worker == 1 and llm["num_gpus"] > 0.5
    assert vocoder["resources"] == {"vocoder_slot": 1} and "resources" not in llm
    # what Ray's autoscaler reads from the group (and KubeRay starts the worker with): its card, its CPUs, one slot
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    offered = _get_ray_resources_from_group_spec(group, is_head=False)
    assert (offered["GPU"], offered["vocoder_slot"], offered["CPU"]) == (1, 1, int(worker["resources"]["limits"]["cpu"]))
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert "vocoder_slot" not in _get_ray_resources_from_group_spec(head, is_head=True)
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
    assert max(o["autoscaling_config"]["max_replicas"] for o in (llm, vocoder)) <= group["maxReplicas"]
    cpus_per_worker = int(worker["resources"]["limits"]["cpu"])
    assert llm["num_cpus"] + vocoder["num_cpus"] + args["ingress_options"]["num_cpus"] <= cpus_per_worker


def leaf_differences(a: Any, b: Any, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Paths of the leaves (or whole subtrees of different type) where two parsed YAML trees differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(leaf_differences(a.get(k), b.get(k), (*path, k)) for k in a.keys() | b.keys()))
    return set() if a == b else {path}


def test_serve_config_mirrors_config_serve_4090_except_for_cluster_settings(
        serve_config: dict[str, Any]) -> None:
    local = yaml.safe_load((REPO / "config" / "serve-4090.yaml").read_text())
    assert leaf_differences(serve_config, local) == {
        ("proxy_location",),  # every worker runs a proxy: the serve Service and readiness probe need it
        ("applications",),    # compared below, one application each
    }
    (ours,), (theirs,) = serve_config["applications"], local["applications"]
    assert leaf_differences(ours, theirs) == {
        ("args", "require_gpus_at_start"),  # GPU workers join later, through the KubeRay autoscaler
        ("args", "llm_options", "autoscaling_config", "max_replicas"),
        ("args", "vocoder_options", "autoscaling_config", "max_replicas"),
        ("args", "vocoder_options", "resources"),  # one vocoder per worker: see the test above
    }
    assert (serve_config["proxy_location"], ours["args"]["require_gpus_at_start"]) == ("EveryNode", False)


def test_every_container_has_probes_pinned_resources_and_the_project_image(rayservice: dict[str, Any]) -> None:
    images = set()
    for container in containers(rayservice):
        assert {"readinessProbe", "livenessProbe"} <= set(container), container["name"]
        assert container["resources"]["requests"] == container["resources"]["limits"], container["name"]
        images.add(container["image"])
    assert len(images) == 1
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"
    worker = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert "/-/healthz" in " ".join(worker["readinessProbe"]["exec"]["command"])  # the Serve proxy


def test_dockerfile_copies_existing_paths_and_matches_the_ray_pin() -> None:
    import ray

    text = (K8S / "Dockerfile").read_text()
    (base,) = re.findall(r"^ARG BASE_IMAGE=rayproject/ray:([\d.]+)-py311-cu\d+$", text, re.MULTILINE)
    assert base == ray.__version__ == "2.60.0"
    copied = [src for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.MULTILINE) for src in line.split()]
    assert copied == ["pyproject.toml", "runtime", "vocoder", "deployments", "config"]
    assert [p for p in copied if not (REPO / p).exists()] == []
    assert "RUN pip install --no-cache-dir ." in text
    (cmd,) = re.findall(r'^CMD \["serve", "run", "([^"]+)"\]$', text, re.MULTILINE)
    assert cmd == "config/serve-4090.yaml"


def test_prometheus_operator_monitors_select_ray_pods_on_the_metrics_port(rayservice: dict[str, Any]) -> None:
    ports = {p["name"]: p["containerPort"] for c in containers(rayservice) for p in c["ports"]}
    assert ports["metrics"] == 8080
    start_params = [rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"],
                    *(g["rayStartParams"] for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"])]
    assert {p["metrics-export-port"] for p in start_params} == {"8080"}

    pod_monitor = load_yaml("podmonitor.yaml")
    assert (pod_monitor["apiVersion"], pod_monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert pod_monitor["metadata"]["name"] == "moss-speech-ray-workers"
    assert [e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    worker_labels = {**rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["metadata"]
                     ["labels"], "ray.io/node-type": "worker"}  # the second one KubeRay adds
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= worker_labels.items()

    service_monitor = load_yaml("servicemonitor.yaml")
    assert (service_monitor["apiVersion"], service_monitor["kind"]) == ("monitoring.coreos.com/v1",
                                                                        "ServiceMonitor")
    assert service_monitor["metadata"]["name"] == "moss-speech-ray-head"
    assert service_monitor["spec"]["selector"]["matchLabels"] == {
        "ray.io/node-type": "head", "ray.io/originated-from-crd": "RayService",
        "ray.io/originated-from-cr-name": rayservice["metadata"]["name"]}
    assert [e["port"] for e in service_monitor["spec"]["endpoints"]] == ["metrics"]
    # Head and worker series both carry the cluster's name, taken from the pod's label: the head Service that
    # KubeRay builds for a RayService has no ray.io/cluster label, so targetLabels naming it copied nothing,
    # and jobLabel named labels no Service or pod has
    for monitor, endpoints in ((service_monitor, "endpoints"), (pod_monitor, "podMetricsEndpoints")):
        assert "targetLabels" not in monitor["spec"] and "jobLabel" not in monitor["spec"]
        (endpoint,) = monitor["spec"][endpoints]
        assert endpoint["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"],
                                            "targetLabel": "ray_io_cluster"}]


def test_plain_prometheus_scrape_config_keeps_only_the_metrics_port() -> None:
    config = load_yaml("prometheus-scrape.yaml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"moss-speech-ray", "moss-speech-local"}
    keep = [r for r in jobs["moss-speech-ray"]["relabel_configs"] if r.get("action") == "keep"]
    by_source = {tuple(r["source_labels"]): re.compile(r["regex"]) for r in keep}
    assert by_source[("__meta_kubernetes_pod_container_port_name",)].fullmatch("metrics")
    assert not by_source[("__meta_kubernetes_pod_container_port_name",)].fullmatch("serve")
    pod_key = ("__meta_kubernetes_pod_label_ray_io_is_ray_node",
               "__meta_kubernetes_pod_label_app_kubernetes_io_name")
    assert by_source[pod_key].fullmatch("yes;moss-speech")
    assert not by_source[pod_key].fullmatch("yes;other-service")
    assert jobs["moss-speech-local"]["static_configs"] == [{"targets": ["127.0.0.1:8080"]}]
