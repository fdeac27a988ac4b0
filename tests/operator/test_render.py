"""Pure rendering: an M3Deployment in, its children out."""

import copy
import math

import pytest
import yaml

from m3stack.operator.quantity import parse_quantity
from m3stack.operator.render import ALL_CHILD_KINDS, kind_of, render_children
from m3stack.operator.render.names import CONFIG_HASH_ANNOTATION, MANAGED_BY_LABEL, OPERATOR_NAME
from m3stack.operator.spec import M3Deployment


def _by_kind(children):
    return {(child["kind"], child["metadata"]["name"]): child for child in children}


def _container(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_minimal_resource_renders_the_core_children(make_m3d, images):
    children = render_children(make_m3d(), images)
    assert sorted(_by_kind(children)) == [
        ("ConfigMap", "demo-config"),
        ("Deployment", "demo-engine"),
        ("Deployment", "demo-gateway"),
        ("NetworkPolicy", "demo-engine"),
        ("PodDisruptionBudget", "demo-engine"),
        ("PodDisruptionBudget", "demo-gateway"),
        ("Service", "demo-engine"),
        ("Service", "demo-gateway"),
    ]
    assert children[0]["kind"] == "ConfigMap", "configuration is applied before the pods that read it"
    for child in children:
        assert child["metadata"]["namespace"] == "models"
        assert child["metadata"]["labels"][MANAGED_BY_LABEL] == OPERATOR_NAME
        assert kind_of(child) in ALL_CHILD_KINDS


def test_rendering_is_pure(make_m3d, images):
    m3d = make_m3d({"engine": {"kvCache": {"cpuOffload": {"size": "8Gi"}}}})
    first = render_children(m3d, images)
    pristine = copy.deepcopy(first)
    first[3]["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "X"})
    first[0]["data"]["poison"] = "1"
    assert render_children(m3d, images) == pristine


def test_selectors_select_the_pods_they_belong_to(make_m3d, images):
    children = _by_kind(render_children(make_m3d({"autoscaling": {"gateway": {"enabled": True}}}), images))
    for component in ("engine", "gateway"):
        pod_labels = children[("Deployment", f"demo-{component}")]["spec"]["template"]["metadata"]["labels"]
        selectors = [
            children[("Deployment", f"demo-{component}")]["spec"]["selector"]["matchLabels"],
            children[("Service", f"demo-{component}")]["spec"]["selector"],
            children[("PodDisruptionBudget", f"demo-{component}")]["spec"]["selector"]["matchLabels"],
        ]
        for selector in selectors:
            assert selector and selector.items() <= pod_labels.items()
        other = "gateway" if component == "engine" else "engine"
        other_labels = children[("Deployment", f"demo-{other}")]["spec"]["template"]["metadata"]["labels"]
        assert not selectors[0].items() <= other_labels.items()


def test_engine_pod_gets_gpus_memory_for_offload_probes_and_drain(make_m3d, images):
    m3d = make_m3d(
        {
            "engine": {
                "accelerator": {"count": 8, "product": "NVIDIA-B200"},
                "resources": {"requests": {"cpu": "16", "memory": "96Gi"}, "limits": {"memory": "100Gi"}},
                "kvCache": {"cpuOffload": {"size": "512Gi"}},
                "startup": {"timeoutSeconds": 905},
                "drain": {"preStopSeconds": 20, "shutdownTimeoutSeconds": 120},
                "shmSize": "32Gi",
            }
        }
    )
    deployment = _by_kind(render_children(m3d, images))[("Deployment", "demo-engine")]
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 8
    assert parse_quantity(resources["requests"]["memory"]) == parse_quantity("96Gi") + parse_quantity("512Gi")
    assert parse_quantity(resources["limits"]["memory"]) == parse_quantity("100Gi") + parse_quantity("512Gi")
    assert resources["requests"]["cpu"] == "16"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-B200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/loaded"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 905
    assert startup["failureThreshold"] == math.ceil(905 / startup["periodSeconds"])
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in container["ports"]
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == 20
    assert pod["terminationGracePeriodSeconds"] >= 20 + 120
    shm = next(volume for volume in pod["volumes"] if volume["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert deployment["spec"]["progressDeadlineSeconds"] > 905


def test_cpu_engine_requests_no_device_and_offload_alone_sets_the_memory_request(make_m3d, images):
    m3d = make_m3d(
        {
            "engine": {
                "accelerator": {"count": 0},
                "resources": {"requests": {"cpu": "2"}},
                "kvCache": {"cpuOffload": {"size": "3Gi"}},
            }
        }
    )
    deployment = _by_kind(render_children(m3d, images))[("Deployment", "demo-engine")]
    container = _container(deployment)
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "3Gi"}}
    assert "tolerations" not in deployment["spec"]["template"]["spec"]
    assert container["args"][container["args"].index("--device") + 1] == "cpu"


def test_the_quick_start_example_runs_the_baked_tiny_model_on_cpu_without_volumes(repo_root, images):
    # The chart's example is what README's quick start applies: engine and gateway both read `--model default`
    # from their images (no claim to prepare), the engine asks for no GPU, and an Ingress fronts the gateways.
    example = yaml.safe_load((repo_root / "helm" / "m3stack" / "examples" / "m3deployment.yaml").read_text())
    example["metadata"].update(namespace="default", uid="u", generation=1)
    children = _by_kind(render_children(M3Deployment.from_body(example), images))
    assert ("Ingress", "tiny") in children
    for component in ("engine", "gateway"):
        deployment = children[("Deployment", f"tiny-{component}")]
        container, pod = _container(deployment), deployment["spec"]["template"]["spec"]
        assert container["args"][container["args"].index("--model") + 1] == "default"
        assert not [volume for volume in pod["volumes"] if "persistentVolumeClaim" in volume]
        assert not [value for bucket in container["resources"].values() for value in bucket if "gpu" in value]
        assert "nodeSelector" not in pod and "tolerations" not in pod
    engine = _container(children[("Deployment", "tiny-engine")])
    assert engine["args"][engine["args"].index("--device") + 1] == "cpu"


def test_replicas_follow_the_spec_and_suspend_scales_everything_to_zero(make_m3d, images):
    spec = {"engine": {"replicas": 3}, "gateway": {"replicas": 4}, "autoscaling": {"gateway": {"enabled": True}}}
    running = _by_kind(render_children(make_m3d(spec), images))
    assert running[("Deployment", "demo-engine")]["spec"]["replicas"] == 3
    assert "replicas" not in running[("Deployment", "demo-gateway")]["spec"], "the HPA owns the gateway's replicas"
    hpa = running[("HorizontalPodAutoscaler", "demo-gateway")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "demo-gateway"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 16)

    suspended = _by_kind(render_children(make_m3d({**spec, "suspend": True}), images))
    assert suspended[("Deployment", "demo-engine")]["spec"]["replicas"] == 0
    assert suspended[("Deployment", "demo-gateway")]["spec"]["replicas"] == 0
    assert ("HorizontalPodAutoscaler", "demo-gateway") not in suspended, "an HPA would scale it back up"

    manual = _by_kind(render_children(make_m3d({"gateway": {"replicas": 4}}), images))
    assert manual[("Deployment", "demo-gateway")]["spec"]["replicas"] == 4


def test_engine_service_is_headless_and_the_gateway_is_told_its_address(make_m3d, images):
    children = _by_kind(render_children(make_m3d({"engine": {"grpcPort": 6000}}, namespace="prod"), images))
    service = children[("Service", "demo-engine")]
    assert service["spec"]["clusterIP"] == "None"
    assert {port["port"] for port in service["spec"]["ports"]} == {6000, 9400}
    args = _container(children[("Deployment", "demo-gateway")])["args"]
    assert args[args.index("--engine-service") + 1] == "demo-engine.prod.svc:6000"


def _allowed(policy, peer_labels: dict[str, str], port: str) -> bool:
    """Whether ``policy`` lets a pod with ``peer_labels`` open ``port`` (a named container port) on its pods."""
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from")
        peer_ok = peers is None or any(p["podSelector"]["matchLabels"].items() <= peer_labels.items() for p in peers)
        ports = rule.get("ports")
        if peer_ok and (ports is None or any(p["port"] == port for p in ports)):
            return True
    return False


def test_only_the_resources_gateways_reach_the_engines_grpc_port(make_m3d, images):
    children = _by_kind(render_children(make_m3d({"engine": {"multiNode": {"size": 2}, "accelerator": {"count": 1},
                                                             "parallelism": {"tensor": 2}}}), images))  # fmt: skip
    policy = children[("NetworkPolicy", "demo-engine")]
    workload = children[("LeaderWorkerSet", "demo-engine")]["spec"]["leaderWorkerTemplate"]
    engine_pods = [workload[role]["metadata"]["labels"] for role in ("leaderTemplate", "workerTemplate")]
    gateway_pod = children[("Deployment", "demo-gateway")]["spec"]["template"]["metadata"]["labels"]
    for pod in engine_pods:  # the policy governs every engine pod, leaders and workers
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    other_gateway = {**gateway_pod, "m3stack.io/deployment": "other"}
    stranger = {"app": "debug-shell"}
    assert _allowed(policy, gateway_pod, "grpc")
    assert not _allowed(policy, other_gateway, "grpc") and not _allowed(policy, stranger, "grpc")
    assert _allowed(policy, engine_pods[1], "rendezvous") and not _allowed(policy, gateway_pod, "rendezvous")
    assert _allowed(policy, stranger, "metrics")
    ports = {p["name"] for p in workload["leaderTemplate"]["spec"]["containers"][0]["ports"]}
    assert {"grpc", "metrics", "rendezvous"} <= ports  # the names the policy uses are the pods' own


def test_the_network_policy_can_be_turned_off(make_m3d, images):
    children = render_children(make_m3d({"engine": {"networkPolicy": False}}), images)
    assert "NetworkPolicy" not in {child["kind"] for child in children}


def test_checkpoint_claim_is_mounted_read_only_in_both_tiers(make_m3d, images):
    m3d = make_m3d({"model": {"path": "/weights/m3", "pvc": {"claimName": "m3-weights", "mountPath": "/weights"}}})
    children = _by_kind(render_children(m3d, images))
    for component in ("engine", "gateway"):
        deployment = children[("Deployment", f"demo-{component}")]
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "m3-weights", "readOnly": True}} in volumes
        container = _container(deployment)
        assert {"name": "model", "mountPath": "/weights", "readOnly": True} in container["volumeMounts"]
        assert container["args"][container["args"].index("--model") + 1] == "/weights/m3"


def test_ingress_routes_to_the_gateway_service(make_m3d, images):
    m3d = make_m3d(
        {
            "exposure": {
                "ingress": {
                    "host": "m3.example.com",
                    "className": "nginx",
                    "tls": {"secretName": "m3-tls"},
                    "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"},
                }
            }
        }
    )
    ingress = _by_kind(render_children(m3d, images))[("Ingress", "demo")]
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "m3.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": "demo-gateway", "port": {"name": "http"}}
    assert ingress["spec"]["tls"] == [{"hosts": ["m3.example.com"], "secretName": "m3-tls"}]
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/proxy-buffering": "off"}


def _hashes(m3d, images):
    children = _by_kind(render_children(m3d, images))
    return tuple(
        children[("Deployment", f"demo-{component}")]["spec"]["template"]["metadata"]["annotations"][
            CONFIG_HASH_ANNOTATION
        ]
        for component in ("engine", "gateway")
    )


def test_a_setting_change_rolls_only_the_pods_that_read_it(make_m3d, images):
    engine_hash, gateway_hash = _hashes(make_m3d(), images)
    new_engine_hash, same_gateway_hash = _hashes(
        make_m3d({"engine": {"drain": {"shutdownTimeoutSeconds": 77}}}), images
    )
    assert new_engine_hash != engine_hash
    assert same_gateway_hash == gateway_hash
    assert all(
        new != old
        for new, old in zip(
            _hashes(make_m3d({"model": {"name": "other"}}), images), (engine_hash, gateway_hash), strict=True
        )
    )


@pytest.mark.parametrize(
    ("engine", "variables"),
    [
        (
            {"kvCache": {"indexDtype": "fp8_e4m3", "dtype": "fp8_e4m3"}},
            {"M3STACK_ENGINE_INDEX_DTYPE": "fp8_e4m3", "M3STACK_ENGINE_KV_CACHE_DTYPE": "fp8_e4m3"},
        ),
        (
            {"maxModelLen": 262144, "gpuMemoryUtilization": 0.8},
            {"M3STACK_ENGINE_MAX_MODEL_LEN": "262144", "M3STACK_ENGINE_GPU_MEMORY_UTILIZATION": "0.8"},
        ),
    ],
    ids=["cache-dtypes", "context-and-memory"],
)
def test_engine_sizing_fields_reach_the_engine_and_roll_only_its_pods(make_m3d, images, engine, variables):
    data = _by_kind(render_children(make_m3d({"engine": engine}), images))[("ConfigMap", "demo-config")]["data"]
    assert {name: data[name] for name in variables} == variables
    engine_hash, gateway_hash = _hashes(make_m3d(), images)
    new_engine_hash, new_gateway_hash = _hashes(make_m3d({"engine": engine}), images)
    assert new_engine_hash != engine_hash and new_gateway_hash == gateway_hash


def test_user_environment_and_extra_args_come_last_and_win(make_m3d, images):
    m3d = make_m3d(
        {
            "engine": {
                "env": [
                    {"name": "HOME", "value": "/data"},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}},
                ],
                "extraArgs": ["--max-num-seqs", "64"],
            }
        }
    )
    container = _container(_by_kind(render_children(m3d, images))[("Deployment", "demo-engine")])
    names = [variable["name"] for variable in container["env"]]
    assert names == ["HOME", "HF_TOKEN"]
    assert container["env"][0]["value"] == "/data"
    assert container["args"][-2:] == ["--max-num-seqs", "64"]
    assert container["envFrom"] == [{"configMapRef": {"name": "demo-config"}}]


def test_pods_run_locked_down(make_m3d, images):
    for child in render_children(make_m3d(), images):
        if child["kind"] != "Deployment":
            continue
        pod = child["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        container = _container(child)
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["image"] in (images.engine, images.gateway)


def test_a_failed_container_leaves_its_last_log_lines_as_its_termination_message(make_m3d, images):
    # The status reads lastState.terminated.message to say why a pod crash-loops (test_status.py).
    for child in render_children(make_m3d(), images):
        if child["kind"] == "Deployment":
            assert _container(child)["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_images_named_in_the_spec_win(make_m3d, images):
    m3d = make_m3d({"engine": {"image": "mine/engine:2"}, "gateway": {"image": "mine/gateway:2"}})
    children = _by_kind(render_children(m3d, images))
    assert _container(children[("Deployment", "demo-engine")])["image"] == "mine/engine:2"
    assert _container(children[("Deployment", "demo-gateway")])["image"] == "mine/gateway:2"


def test_compiled_kernels_go_to_the_shared_claim_when_there_is_one(make_m3d, images):
    plain = _by_kind(render_children(make_m3d({}), images))[("Deployment", "demo-engine")]
    assert not any(v.get("persistentVolumeClaim") for v in plain["spec"]["template"]["spec"]["volumes"])
    assert "TRITON_CACHE_DIR" not in {v["name"] for v in _container(plain)["env"]}
    m3d = make_m3d({"engine": {"kernelCache": {"claimName": "kernels"}, "env": [
        {"name": "FLASHINFER_WORKSPACE_BASE", "value": "/elsewhere"}]}})  # fmt: skip
    deployment = _by_kind(render_children(m3d, images))[("Deployment", "demo-engine")]
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "kernel-cache", "persistentVolumeClaim": {"claimName": "kernels"}} in volumes
    container = _container(deployment)
    assert {"name": "kernel-cache", "mountPath": "/var/cache/m3stack"} in container["volumeMounts"]
    env = [(v["name"], v["value"]) for v in container["env"]]
    assert ("TRITON_CACHE_DIR", "/var/cache/m3stack/triton") in env
    assert [value for name, value in env if name == "FLASHINFER_WORKSPACE_BASE"] == ["/elsewhere"]  # the spec's wins
