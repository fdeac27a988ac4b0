"""Run the Kubernetes operator that reconciles M3Deployment resources into gateway and engine workloads."""

import argparse
import asyncio
import logging
import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from m3stack import __version__, options
from m3stack.operator.spec_schema import THINKING_MODES
from m3stack.options import OptionGroup

if TYPE_CHECKING:
    from m3stack.operator.leader import ElectionSettings
    from m3stack.operator.render.flags import GatewayDefaults

logger = logging.getLogger(__name__)

# A label key (optional DNS prefix, then a name of up to 63 characters) and value, as the API server checks them.
LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

# Where `scripts/dev images` tags the images it builds (images/README.md); the chart passes its own values.
DEFAULT_IMAGE_REPOSITORY = "localhost/m3stack"


def namespace_list(text: str) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")``; empty means every namespace."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if not name.replace("-", "").isalnum() or name != name.lower() or len(name) > 63:
            raise argparse.ArgumentTypeError(f"not a namespace name: {name!r}")
    return names


def label_map(text: str) -> dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``, checked as Kubernetes label keys and values."""
    labels = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, separator, value = item.partition("=")
        if not separator or not LABEL_KEY.fullmatch(key) or not LABEL_VALUE.fullmatch(value):
            raise argparse.ArgumentTypeError(f"not a KEY=VALUE label: {item!r}")
        labels[key] = value
    return labels


def gateway_metrics_urls(text: str) -> dict[tuple[str | None, str], tuple[str, ...]]:
    from m3stack.operator.autoscaler.metrics_source import parse_explicit_targets

    try:
        return parse_explicit_targets(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_arguments(opts: OptionGroup) -> None:
    opts.add(
        "--namespace",
        type=namespace_list,
        help="comma-separated namespaces to watch (default: all, which needs the chart's ClusterRole)",
    )
    opts.add(
        "--engine-image",
        default=f"{DEFAULT_IMAGE_REPOSITORY}/engine:{__version__}",
        help="engine image for M3Deployments that do not set spec.engine.image",
    )
    opts.add(
        "--gateway-image",
        default=f"{DEFAULT_IMAGE_REPOSITORY}/gateway:{__version__}",
        help="gateway image for M3Deployments that do not set spec.gateway.image",
    )
    add_gateway_default_arguments(opts)
    opts.add(
        "--drift-interval",
        type=options.positive_float,
        default=60.0,
        help="seconds between re-reconciles of every M3Deployment (repairs edited children)",
    )
    opts.add("--liveness-host", default="0.0.0.0", help="listen address of /healthz and /metrics")
    opts.add("--liveness-port", type=options.port, default=8080, help="port of /healthz and /metrics")
    opts.flag(
        "--leader-election",
        help="run as one of several replicas: only the holder of a coordination.k8s.io Lease reconciles, the "
        "others stand by and take over within 12 s of its loss",
    )
    opts.add(
        "--leader-election-namespace",
        help="namespace of the Lease (default: the pod's own, from POD_NAMESPACE or the service account)",
    )
    opts.add("--leader-election-lease", default="m3stack-operator", help="name of the Lease")
    opts.add(
        "--leader-election-identity",
        help="this replica's name in the Lease (default: POD_NAME, else the host name and process id)",
    )
    opts.add("--workers", type=options.positive_int, default=8, help="threads running reconciles in parallel")
    opts.flag(
        "--service-monitor",
        default=True,
        help="render a Prometheus Operator ServiceMonitor per M3Deployment (gateway and engine /metrics) when the "
        "cluster serves monitoring.coreos.com/v1 ServiceMonitors",
    )
    opts.add(
        "--service-monitor-labels",
        type=label_map,
        default={},
        help="KEY=VALUE[,KEY=VALUE...]: labels of every ServiceMonitor, so the Prometheus meant to scrape them "
        "selects them (kube-prometheus-stack: release=<its release name>)",
    )
    opts.add(
        "--autoscaler-interval",
        type=options.positive_float,
        default=2.0,
        help="seconds between two decisions of the built-in engine autoscaler (one read of each gateway's "
        "/metrics per M3Deployment in mode Builtin)",
    )
    opts.add(
        "--autoscaler-scrape-timeout",
        type=options.positive_float,
        default=1.0,
        help="seconds one gateway's /metrics may take before it counts as unanswered",
    )
    opts.add(
        "--autoscaler-metrics-urls",
        type=gateway_metrics_urls,
        help="'[NAMESPACE/]NAME=URL[,URL...][;...]': read these gateway /metrics URLs instead of discovering "
        "gateway pods; resources not listed are then not scraped (an operator outside the cluster, tests)",
    )


def add_gateway_default_arguments(opts: OptionGroup) -> None:
    """Gateway settings for M3Deployments that leave the field unset (the chart's gatewayDefaults values); a
    flag not given leaves the gateway's own default."""
    unset = "for M3Deployments that do not set spec.gateway."
    opts.add(
        "--gateway-thinking-mode",
        choices=list(THINKING_MODES),
        help=f"the gateway's --thinking-mode {unset}thinkingMode",
    )
    for flag, field, kind in (
        ("--gateway-max-request-bytes", "limits.maxRequestBytes", options.positive_int),
        ("--gateway-max-request-prompts", "limits.maxRequestPrompts", options.positive_int),
        ("--gateway-max-request-sequences", "limits.maxRequestSequences", options.positive_int),
        ("--gateway-rate-limit-rps", "rateLimits.requestsPerSecond", options.non_negative_float),
        ("--gateway-rate-limit-tpm", "rateLimits.tokensPerMinute", options.non_negative_int),
        ("--gateway-rate-limit-concurrency", "rateLimits.concurrentRequests", options.non_negative_int),
    ):
        opts.add(flag, type=kind, help=f"the gateway's --{flag.removeprefix('--gateway-')} {unset}{field}")


def gateway_defaults(args: argparse.Namespace) -> "GatewayDefaults":
    from m3stack.operator.render.flags import GatewayDefaults
    from m3stack.operator.spec import RateLimits, RequestLimits

    return GatewayDefaults(
        thinking_mode=args.gateway_thinking_mode,
        limits=RequestLimits(
            args.gateway_max_request_bytes, args.gateway_max_request_prompts, args.gateway_max_request_sequences
        ),
        rate_limits=RateLimits(
            args.gateway_rate_limit_rps, args.gateway_rate_limit_tpm, args.gateway_rate_limit_concurrency
        ),
    )


def run(args: argparse.Namespace) -> int:
    # kopf and the Kubernetes client are imported here so `m3stack --help` stays fast.
    from m3stack.operator.autoscaler.daemon import AutoscalerOptions
    from m3stack.operator.autoscaler.metrics_source import MetricsTargets
    from m3stack.operator.render import Images
    from m3stack.operator.render.monitoring import Monitoring
    from m3stack.operator.runner import OperatorOptions, serve

    try:
        election = election_settings(args)
    except ValueError as error:
        logger.error("%s", error)
        return 2
    operator_options = OperatorOptions(
        namespaces=args.namespace or (),
        images=Images(engine=args.engine_image, gateway=args.gateway_image),
        drift_interval_seconds=args.drift_interval,
        liveness_host=args.liveness_host,
        liveness_port=args.liveness_port,
        workers=args.workers,
        autoscaler=AutoscalerOptions(
            interval_s=args.autoscaler_interval,
            scrape_timeout_s=args.autoscaler_scrape_timeout,
            targets=MetricsTargets(args.autoscaler_metrics_urls or {}),
        ),
        leader_election=election,
        monitoring=Monitoring(labels=args.service_monitor_labels) if args.service_monitor else None,
        gateway_defaults=gateway_defaults(args),
    )
    scope = ", ".join(operator_options.namespaces) or "all namespaces"
    logger.info("m3stack operator %s watching %s", __version__, scope)
    return asyncio.run(serve(operator_options))


def election_settings(args: argparse.Namespace) -> "ElectionSettings | None":
    from m3stack.operator.leader import ElectionSettings

    if not args.leader_election:
        return None
    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE")
    if not namespace and SERVICE_ACCOUNT_NAMESPACE.is_file():
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    if not namespace:
        raise ValueError("--leader-election: give --leader-election-namespace (not in a pod, no POD_NAMESPACE)")
    identity = args.leader_election_identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    return ElectionSettings(namespace=namespace, identity=identity, name=args.leader_election_lease)
