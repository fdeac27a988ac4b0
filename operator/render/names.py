"""Names, labels and addresses of an M3Deployment's children: the one place they are decided."""

from m3stack.operator.crd import GROUP
from m3stack.operator.spec import M3Deployment

# Field manager of every server-side apply; also the value of the managed-by label.
OPERATOR_NAME = "m3stack-operator"

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
DEPLOYMENT_LABEL = f"{GROUP}/deployment"
COMPONENT_LABEL = f"{GROUP}/component"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"

GATEWAY = "gateway"
ENGINE = "engine"
CONFIG = "config"


def child_name(m3d: M3Deployment, component: str) -> str:
    """``<name>-gateway``, ``<name>-engine``, ``<name>-config``; the CRD caps names so these stay DNS-1035 labels."""
    return f"{m3d.name}-{component}"


def ingress_name(m3d: M3Deployment) -> str:
    return m3d.name


def selector_labels(m3d: M3Deployment, component: str) -> dict[str, str]:
    """Pod selector of one component (immutable on Deployments, so it never changes)."""
    return {DEPLOYMENT_LABEL: m3d.name, COMPONENT_LABEL: component}


def labels(m3d: M3Deployment, component: str) -> dict[str, str]:
    """Labels of every child and pod: the selector plus the recommended app.kubernetes.io set."""
    return {
        "app.kubernetes.io/name": "m3stack",
        "app.kubernetes.io/instance": m3d.name,
        "app.kubernetes.io/component": component,
        MANAGED_BY_LABEL: OPERATOR_NAME,
        **selector_labels(m3d, component),
    }


def child_metadata(m3d: M3Deployment, component: str) -> dict[str, object]:
    """Name, namespace and labels of the child of a component that is named after it."""
    return {"name": child_name(m3d, component), "namespace": m3d.namespace, "labels": labels(m3d, component)}


def selector_string(m3d: M3Deployment, component: str) -> str:
    """The selector as the /scale subresource and `kubectl get -l` want it."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(m3d, component).items()))


def engine_service_address(m3d: M3Deployment) -> str:
    """DNS name of the headless engine Service: resolves to one address per ready engine pod."""
    return f"{child_name(m3d, ENGINE)}.{m3d.namespace}.svc"


def gateway_url(m3d: M3Deployment) -> str:
    """Base URL of the OpenAI API: the Ingress when there is one, else the in-cluster Service."""
    ingress = m3d.spec.exposure.ingress
    if ingress is not None and ingress.host:
        scheme = "https" if ingress.tls_secret_name else "http"
        return f"{scheme}://{ingress.host}{ingress.path.rstrip('/')}/v1"
    return f"http://{child_name(m3d, GATEWAY)}.{m3d.namespace}.svc:{m3d.spec.gateway.port}/v1"
