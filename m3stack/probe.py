"""Send a chat completion through each gateway and check the answer's shape (the chart's `helm test` hook).

Gateways come from --url (OpenAI base URLs, e.g. a local stack's http://127.0.0.1:8000/v1) or from
--discover: every M3Deployment in the given namespaces (all by default), reached through its gateway
Service inside the cluster.  Each gateway's model comes from its /v1/models.  Exit 0 when every gateway
answered a well-formed chat completion, 1 naming each that did not, 2 on bad arguments.
"""

import argparse
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from m3stack import options
from m3stack.options import OptionGroup

if TYPE_CHECKING:
    from m3stack.operator.apply import Cluster

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")
PROMPT = "Reply with one word: ready?"


@dataclass(frozen=True)
class Gateway:
    name: str  # what the log lines call it: the M3Deployment, or the URL
    base_url: str  # the OpenAI base URL, ending in /v1


def chat_completion_problems(body: Any, model: str, max_tokens: int) -> list[str]:
    """What is wrong with a chat completion response body (empty when it has the OpenAI shape)."""
    if not isinstance(body, dict):
        return [f"the body is not a JSON object: {str(body)[:200]}"]
    problems = []
    if body.get("object") != "chat.completion":
        problems.append(f"object is {body.get('object')!r}, not 'chat.completion'")
    if not isinstance(body.get("id"), str) or not body["id"]:
        problems.append("no id")
    if body.get("model") != model:
        problems.append(f"model is {body.get('model')!r}, not {model!r}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        problems.append(f"choices is not a list of one: {choices!r}"[:300])
    else:
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        if choice.get("index") != 0:
            problems.append("choices[0].index is not 0")
        if message.get("role") != "assistant":
            problems.append(f"choices[0].message.role is {message.get('role')!r}")
        if not isinstance(message.get("content"), str) and not message.get("tool_calls"):
            problems.append("choices[0].message has neither content nor tool_calls")
        if choice.get("finish_reason") not in FINISH_REASONS:
            problems.append(f"choices[0].finish_reason is {choice.get('finish_reason')!r}")
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    counts = [usage.get(key) for key in ("prompt_tokens", "completion_tokens", "total_tokens")]
    if not all(isinstance(count, int) and count >= 0 for count in counts):
        problems.append(f"usage is not three counts: {usage!r}")
    elif counts[0] + counts[1] != counts[2] or counts[0] <= 0 or not 0 < counts[1] <= max_tokens:
        problems.append(f"usage does not add up: {usage!r}")
    return problems


def probe(gateway: Gateway, api_key: str | None, timeout_s: float, max_tokens: int = 4) -> list[str]:
    """One chat completion through ``gateway``: the problems found (empty: it works)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=timeout_s) as client:
            models = client.get("/models")
            if models.status_code != 200:
                return [f"GET /models answered {models.status_code}: {models.text[:300]}"]
            model = models.json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens}
            response = client.post("/chat/completions", json=body)
            if response.status_code != 200:
                return [f"POST /chat/completions answered {response.status_code}: {response.text[:300]}"]
            return chat_completion_problems(response.json(), model, max_tokens)
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        return [f"{type(error).__name__}: {error}"]


def discover(namespaces: tuple[str, ...], cluster: "Cluster | None" = None) -> list[Gateway]:
    """Every M3Deployment's gateway Service (in-cluster DNS) in ``namespaces`` (empty: all); ``cluster``: the API
    server (default: the pod's service account, else KUBECONFIG)."""
    from m3stack.operator.apply import M3DEPLOYMENT, Cluster
    from m3stack.operator.render.names import GATEWAY, child_name
    from m3stack.operator.runner import api_client
    from m3stack.operator.spec import M3Deployment

    cluster = cluster or Cluster(api_client(connections=1))
    bodies = [body for namespace in namespaces or (None,) for body in cluster.list(M3DEPLOYMENT, namespace)]
    gateways = []
    for body in bodies:
        m3d = M3Deployment.from_body(body)
        host = f"{child_name(m3d, GATEWAY)}.{m3d.namespace}.svc"
        gateways.append(Gateway(f"{m3d.namespace}/{m3d.name}", f"http://{host}:{m3d.spec.gateway.port}/v1"))
    return gateways


def add_arguments(opts: OptionGroup) -> None:
    opts.add("--url", type=_urls, default=(), help="comma-separated OpenAI base URLs of gateways (…/v1)")
    opts.flag("--discover", help="every M3Deployment's gateway Service, found through the Kubernetes API")
    opts.add(
        "--namespace", type=_namespaces, default=(), help="comma-separated namespaces for --discover (default: all)"
    )
    opts.add("--api-key", help="bearer token for gateways with API keys (default: $M3STACK_API_KEY)")
    opts.add("--timeout", type=options.positive_float, default=120.0, help="seconds one gateway may take")


def _urls(text: str) -> tuple[str, ...]:
    urls = tuple(url.strip().rstrip("/") for url in text.split(",") if url.strip())
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"not an http(s) URL: {url!r}")
    return urls


def _namespaces(text: str) -> tuple[str, ...]:
    from m3stack.operator.cli import namespace_list

    return namespace_list(text)


def run(args: argparse.Namespace) -> int:
    if bool(args.url) == bool(args.discover):
        logger.error("give --url or --discover")
        return 2
    gateways = [Gateway(url, url) for url in args.url]
    if args.discover:
        gateways = discover(args.namespace)
        if not gateways:
            logger.error("no M3Deployment found in %s", ", ".join(args.namespace) or "any namespace")
            return 1
    api_key = args.api_key or os.environ.get("M3STACK_API_KEY")
    failed = 0
    for gateway in gateways:
        problems = probe(gateway, api_key, args.timeout)
        if problems:
            failed += 1
            logger.error("%s (%s): %s", gateway.name, gateway.base_url, "; ".join(problems))
        else:
            logger.info("%s (%s): a well-formed chat completion", gateway.name, gateway.base_url)
    return 1 if failed else 0
