"""The README's "Serving on Kubernetes", as written, on the real node.

The steps' commands are read from README.md and run with bash (python blocks through the project's
Python, which has the openai client), so the README cannot drift from what works:

1. `scripts/dev images` and 2. the `ctr images import` loop are the k8s_real_cluster fixture's own work
   (it runs the same command and imports the same archives into the node's containerd, skipping images it
   already holds); the test checks that the tags the chart defaults to are there, on the images this tree
   built, and runs step 2's loop only when asked (M3STACK_QUICKSTART_IMPORT=1: it re-reads 7 GB, 103 s here).
3. `helm install` with the chart's defaults: the operator runs as a pod with the chart's ServiceAccount,
   RBAC and in-cluster config.
4. `kubectl apply` of helm/m3stack/examples/m3deployment.yaml and `kubectl wait` until Ready, in a fresh
   namespace (the current namespace of the kubeconfig the commands get, as a user's context would have).
5. curl through the Traefik Ingress at the address `kubectl get ingress` shows, then the README's OpenAI
   client snippet streaming a chat completion with a picture.
6. `helm test`: the chart's probe pod reaches the gateways through their Service.
7. `kubectl delete m3d` and `helm uninstall`: every child goes, the operator goes, the CRD stays.

Then the test's own figures through the same Ingress with the official openai client (time to first token
and to the last chunk of streamed chat completions with an image), and the proof that they went through
both gateway pods' API and the engine pod (their Prometheus pages, read from the pod IPs).  Every address
contacted is one node_host.ours() accepts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import node_host
import openai
import pytest
import yaml
from m3d_testkit import CHART, EXAMPLE, RELEASE, RELEASE_NAMESPACE, REPO_ROOT, SERVICE_ACCOUNT, Kube
from realnode import RealCluster
from serving_kit import checked_url, scrape, total

from m3stack.local.demo import data_url, demo_image_png
from m3stack.metrics import GATEWAY_REQUESTS
from m3stack.operator.render.names import COMPONENT_LABEL, DEPLOYMENT_LABEL, ENGINE, GATEWAY

log = logging.getLogger(__name__)

README = REPO_ROOT / "README.md"
SECTION = "## Serving on Kubernetes"
STEP_HEADING = re.compile(r"^\*\*(\d+)\. ", re.MULTILINE)
CODE_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
NAME = "tiny"  # the example's M3Deployment
MODEL = "m3-tiny"  # its served model name
GATEWAY_PORT = 8000
CHAT_PATH = "/v1/chat/completions"
ENGINE_METRICS_PORT = 9400
STEP_TIMEOUT_S = 900  # step 4 waits up to 10 minutes (`kubectl wait --timeout=10m`)
MEASURED_REQUESTS = 5
MAX_TOKENS = 16
IMPORT_ENV = "M3STACK_QUICKSTART_IMPORT"


def readme_steps() -> dict[int, list[tuple[str, str]]]:
    """The section's numbered steps: step -> its code blocks, (language, code), in order."""
    text = README.read_text()
    start = text.index(SECTION)
    section = text[start : text.index("\n### ", start)]
    marks = list(STEP_HEADING.finditer(section))
    steps = {}
    for mark, following in zip(marks, [*marks[1:], None], strict=True):
        body = section[mark.start() : following.start() if following else len(section)]
        steps[int(mark.group(1))] = [(match.group(1), match.group(2)) for match in CODE_BLOCK.finditer(body)]
    return steps


def step_script(blocks: list[tuple[str, str]]) -> str:
    """One bash script of a step's blocks, python ones fed to `python` (variables exported by a bash block
    reach them)."""
    parts = []
    for language, code in blocks:
        assert language in ("bash", "python"), f"a README step has a {language} block the test cannot run"
        parts.append(code if language == "bash" else f"python - <<'PYTHON'\n{code}PYTHON\n")
    return "\n".join(parts)


@dataclass
class Shell:
    """Runs README steps as a user would: KUBECONFIG with a current namespace, the cluster's kubectl and helm
    and the project's Python on PATH, ctr on the node's containerd, no proxy settings."""

    cluster: RealCluster
    kubeconfig: Path
    workdir: Path
    installed: bool = False  # step 3 installed the chart's release (so the fixture uninstalls it)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in self.cluster.plane.env(self.kubeconfig).items() if "proxy" not in k.lower()}
        env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
        env["CONTAINERD_ADDRESS"] = str(self.cluster.containerd_socket)
        return env

    def step(self, number: int, cwd: Path = REPO_ROOT) -> tuple[str, float]:
        script = step_script(readme_steps()[number])
        started = time.monotonic()
        result = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=self.env(),
            capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
        )  # fmt: skip
        seconds = time.monotonic() - started
        assert result.returncode == 0, (
            f"README step {number} failed ({result.returncode}):\n{script}\n{result.stdout}\n{result.stderr}"
        )
        log.info("README step %d in %.1f s:\n%s", number, seconds, result.stdout.strip()[-1500:])
        self.installed = self.installed or number == 3
        return result.stdout, seconds


@pytest.fixture
def shell(k8s_real_cluster: RealCluster, k8s_real_namespace: str, tmp_path: Path) -> Iterator[Shell]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(k8s_real_cluster.plane.kubeconfig.read_text())
    k8s_real_cluster.plane.kubectl("config", "set-context", "--current", f"--namespace={k8s_real_namespace}",
                                   kubeconfig=kubeconfig)  # fmt: skip
    shell = Shell(k8s_real_cluster, kubeconfig, tmp_path)
    yield shell
    if not shell.installed:  # a release that was there before is someone else's
        return
    # The release this test installed goes too, after the M3Deployment: later tests install their own.
    plane = k8s_real_cluster.plane
    plane.kubectl("delete", "m3deployment", NAME, "-n", k8s_real_namespace, "--ignore-not-found", "--timeout=120s")
    # Its pods gone before the namespace goes: a namespace deleted while a pod terminates is finished only after
    # that pod's whole grace period (330 s for the example's engine), whenever the pod really stops.
    plane.kubectl("wait", "--for=delete", "pods", "--all", "-n", k8s_real_namespace, "--timeout=120s")
    helm = str(plane.binary("helm"))
    plane.run([helm, "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", "--timeout=2m"], check=False)
    plane.kubectl("delete", "namespace", RELEASE_NAMESPACE, "--ignore-not-found", "--timeout=120s")


def test_readme_lists_the_steps_this_test_runs() -> None:
    steps = readme_steps()
    assert sorted(steps) == [1, 2, 3, 4, 5, 6, 7]
    assert [code.split("#")[0].strip() for _, code in steps[1]] == ["scripts/dev images"]
    assert "ctr -n k8s.io images import" in steps[2][0][1]
    assert [language for language, _ in steps[5]] == ["bash", "python"]
    assert f"kubectl apply -f {EXAMPLE.relative_to(REPO_ROOT)}" in steps[4][0][1]
    assert f"helm install {RELEASE} {CHART.relative_to(REPO_ROOT)} --namespace {RELEASE_NAMESPACE}" in steps[3][0][1]


def _chart_default_tags_are_this_trees_images(cluster: RealCluster) -> None:
    """What steps 1 and 2 leave on a node: the `<version>` tags the chart defaults to name the images this
    tree built (the fixture ran `scripts/dev images` and imported its archives)."""
    listing = cluster.ctr()("images", "list")
    digests = {line.split()[0]: line.split()[2] for line in listing.splitlines()[1:] if line.strip()}
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for component, reference in cluster.images.items():
        default_tag = f"localhost/m3stack/{component}:{version}"
        assert digests.get(default_tag) == digests[reference], f"{default_tag} is not {reference} on the node"


def test_quickstart_as_written(k8s_real_cluster: RealCluster, k8s_real_namespace: str, shell: Shell) -> None:
    cluster = k8s_real_cluster
    if os.environ.get(IMPORT_ENV) == "1":
        shell.step(2)
    _chart_default_tags_are_this_trees_images(cluster)

    _, install_s = shell.step(3)
    kube = Kube(cluster.plane, k8s_real_namespace)
    # The chart's default: two operator replicas under leader election, both with the chart's ServiceAccount.
    selector = f"app.kubernetes.io/name=m3stack-operator,app.kubernetes.io/instance={RELEASE}"
    operators = kube.json("get", "pods", "-n", RELEASE_NAMESPACE, "-l", selector)["items"]
    assert [pod["spec"]["serviceAccountName"] for pod in operators] == [SERVICE_ACCOUNT] * 2, operators

    _, ready_s = shell.step(4)
    # Step 4 returns once the resource serves (Ready: an engine behind a gateway); the counts below expect
    # requests on both gateway pods, so both must be in the Service's endpoints first.
    kube.wait_all_ready(NAME)
    _model_files_agree(kube)

    address = kube.json("get", "ingress", NAME)["status"]["loadBalancer"]["ingress"][0]["ip"]
    assert node_host.ours(address) and address == cluster.node_ip, f"the Ingress's address {address}"
    (shell.workdir / "picture.png").write_bytes(demo_image_png())
    before = _served_counts(kube)
    output, answer_s = shell.step(5, cwd=shell.workdir)
    chunks = _sse_chunks(output)
    assert chunks and all(chunk["object"] == "chat.completion.chunk" and chunk["model"] == MODEL for chunk in chunks)
    usage = re.search(r"^(\d+) prompt tokens, (\d+) completion tokens$", output, re.MULTILINE)
    assert usage, f"the README's client printed no usage:\n{output}"
    image_prompt_tokens = int(usage.group(1))

    figures = _measured_requests(f"http://{address}/v1")
    after = _served_counts(kube)
    requests = 2 + MEASURED_REQUESTS + 1  # curl, the README's client, the measured ones, the text-only one
    assert after.gateway_chats - before.gateway_chats == requests, (before, after)
    assert after.engine_successes - before.engine_successes == requests, (before, after)
    assert all(count > 0 for count in after.per_gateway.values()), f"a gateway pod served nothing: {after}"
    assert image_prompt_tokens == figures.image_prompt_tokens > figures.text_prompt_tokens, figures

    probe_output, probe_s = shell.step(6)
    assert re.search(r"^Phase:\s+Succeeded$", probe_output, re.MULTILINE), probe_output
    _removed_as_the_readme_says(kube, shell)

    log.info(
        "quick start on the real node: helm install --wait %.1f s; apply -> Ready %.1f s; README curl + client "
        "%.1f s; %d streamed chats with a %d-token image prompt through the Ingress: time to first token median "
        "%.0f ms (max %.0f ms), to the last chunk median %.0f ms (max %.0f ms), %d completion tokens each; "
        "text-only prompt %d tokens; helm test %.1f s; requests per gateway pod %s",
        install_s, ready_s, answer_s, MEASURED_REQUESTS, figures.image_prompt_tokens,
        statistics.median(figures.first_token_s) * 1e3, max(figures.first_token_s) * 1e3,
        statistics.median(figures.total_s) * 1e3, max(figures.total_s) * 1e3, MAX_TOKENS,
        figures.text_prompt_tokens, probe_s, after.per_gateway,
    )  # fmt: skip


def _removed_as_the_readme_says(kube: Kube, shell: Shell) -> None:
    """Step 7: the resource's children are garbage-collected, the release's objects go, the CRD stays."""
    shell.step(7)
    kinds = "deployments,replicasets,pods,services,configmaps,poddisruptionbudgets,networkpolicies,ingresses"
    children = ["get", kinds, "-n", kube.namespace, "-l", f"{DEPLOYMENT_LABEL}={NAME}", "-o", "name"]
    release = ["get", "all", "-n", RELEASE_NAMESPACE, "-o", "name"]
    for what, args in (("children of the deleted M3Deployment", children), ("the release's objects", release)):
        deadline = time.monotonic() + 120
        while (left := kube.cluster.kubectl(*args).split()) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, f"{what} left behind: {left}"
    assert kube.cluster.kubectl("get", "crd", "m3deployments.m3stack.io", "-o", "name").strip()


def _model_files_agree(kube: Kube) -> None:
    """The gateway and engine pods read the same tiny model files (both images generate them at build time):
    every file's digest but the weights' (shards and index), which only the engine has."""
    folder = "$(python3 -c 'from m3stack.default_model import tiny_checkpoint_dir as d; print(d())')"
    listing = f'cd "{folder}" && sha256sum *'

    def digests(component: str) -> dict[str, str]:
        pod = kube.json("get", "pods", "-l", f"{DEPLOYMENT_LABEL}={NAME},{COMPONENT_LABEL}={component}")["items"][0]
        output = kube("exec", pod["metadata"]["name"], "--", "sh", "-c", listing)
        return {name: digest for digest, name in (line.split() for line in output.splitlines())}

    gateway, engine = digests(GATEWAY), digests(ENGINE)
    weights = {name for name in engine if ".safetensors" in name}  # the shards and their index
    assert weights and "tokenizer.json" in gateway, (sorted(gateway), sorted(engine))
    assert {name: engine[name] for name in engine.keys() - weights} == gateway


def _sse_chunks(output: str) -> list[dict]:
    """The chunks of the streamed answer curl printed, up to `data: [DONE]` (which must come)."""
    chunks = []
    for line in output.splitlines():
        if line == "data: [DONE]":
            return chunks
        if line.startswith("data: "):
            chunks.append(json.loads(line.removeprefix("data: ")))
    pytest.fail(f"no `data: [DONE]` in curl's output:\n{output}")


@dataclass(frozen=True)
class Counts:
    gateway_chats: float  # 200 answers of the chat route, both gateway pods
    per_gateway: dict[str, float]
    engine_successes: float  # requests the engine pod finished


def _served_counts(kube: Kube) -> Counts:
    def pods(component: str) -> list[dict]:
        selector = f"{DEPLOYMENT_LABEL}={NAME},{COMPONENT_LABEL}={component}"
        return kube.json("get", "pods", "-l", selector)["items"]

    per_gateway = {
        pod["metadata"]["name"]: total(scrape(pod, GATEWAY_PORT), GATEWAY_REQUESTS, status="200", endpoint=CHAT_PATH)
        for pod in pods(GATEWAY)
    }
    engines = pods(ENGINE)
    assert len(per_gateway) == 2 and len(engines) == 1, "the example runs two gateways and one engine"
    successes = total(scrape(engines[0], ENGINE_METRICS_PORT), "vllm:request_success_total")
    return Counts(sum(per_gateway.values()), per_gateway, successes)


@dataclass
class Figures:
    first_token_s: list[float]
    total_s: list[float]
    image_prompt_tokens: int
    text_prompt_tokens: int


def _stream(client: openai.OpenAI, content: list[dict]) -> tuple[float, float, int, int]:
    """One streamed chat completion: seconds to the first content, to the last chunk, prompt and completion
    tokens."""
    started = time.monotonic()
    first = 0.0
    text = ""
    usage = None
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.monotonic() - started
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert usage is not None and text and first, (text, usage)
    return first, time.monotonic() - started, usage.prompt_tokens, usage.completion_tokens


def _measured_requests(base_url: str) -> Figures:
    image = {"type": "image_url", "image_url": {"url": data_url("image/png", demo_image_png())}}
    question = {"type": "text", "text": "Describe it."}
    figures = Figures([], [], 0, 0)
    with httpx.Client(trust_env=False, timeout=120) as http:
        client = openai.OpenAI(base_url=checked_url(base_url), api_key="none", http_client=http, max_retries=0)
        for _ in range(MEASURED_REQUESTS):
            first, seconds, prompt_tokens, completion_tokens = _stream(client, [image, question])
            assert completion_tokens == MAX_TOKENS
            figures.first_token_s.append(first)
            figures.total_s.append(seconds)
            figures.image_prompt_tokens = prompt_tokens
        figures.text_prompt_tokens = _stream(client, [question])[2]
    return figures


def test_step_script_feeds_python_blocks_to_python() -> None:
    script = step_script([("bash", "export A=1\n"), ("python", "print(1)\n")])
    assert script == "export A=1\n\npython - <<'PYTHON'\nprint(1)\nPYTHON\n"
