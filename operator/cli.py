"""Run the Kubernetes operator that reconciles M3Deployment resources into gateway and engine workloads."""

import argparse
import asyncio
import logging

from m3stack import __version__, options
from m3stack.options import OptionGroup

logger = logging.getLogger(__name__)

DEFAULT_IMAGE_REPOSITORY = "ghcr.io/m3stack"


def namespace_list(text: str) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")``; empty means every namespace."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if not name.replace("-", "").isalnum() or name != name.lower() or len(name) > 63:
            raise argparse.ArgumentTypeError(f"not a namespace name: {name!r}")
    return names


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
    opts.add(
        "--drift-interval",
        type=options.positive_float,
        default=60.0,
        help="seconds between re-reconciles of every M3Deployment (repairs edited children)",
    )
    opts.add("--liveness-host", default="0.0.0.0", help="listen address of the liveness endpoint /healthz")
    opts.add("--liveness-port", type=options.port, default=8080, help="port of the liveness endpoint /healthz")
    opts.add("--workers", type=options.positive_int, default=8, help="threads running reconciles in parallel")
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


def run(args: argparse.Namespace) -> int:
    # kopf and the Kubernetes client are imported here so `m3stack --help` stays fast.
    from m3stack.operator.autoscaler.daemon import AutoscalerOptions
    from m3stack.operator.autoscaler.metrics_source import MetricsTargets
    from m3stack.operator.render import Images
    from m3stack.operator.runner import OperatorOptions, serve

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
    )
    scope = ", ".join(operator_options.namespaces) or "all namespaces"
    logger.info("m3stack operator %s watching %s", __version__, scope)
    asyncio.run(serve(operator_options))
    return 0
