"""The ConfigMap holding each component's tunables as M3STACK_<COMMAND>_<FLAG> variables."""

import hashlib
import json
from typing import Any

from m3stack.operator.render.flags import (
    ENGINE_COMMAND,
    GATEWAY_COMMAND,
    GATEWAYS_OWN_DEFAULTS,
    GatewayDefaults,
    engine_settings,
    environment,
    gateway_settings,
)
from m3stack.operator.render.names import CONFIG, child_metadata
from m3stack.operator.spec import M3Deployment


def engine_environment(m3d: M3Deployment) -> dict[str, str]:
    return environment(ENGINE_COMMAND, engine_settings(m3d))


def gateway_environment(m3d: M3Deployment, defaults: GatewayDefaults = GATEWAYS_OWN_DEFAULTS) -> dict[str, str]:
    return environment(GATEWAY_COMMAND, gateway_settings(m3d, defaults))


def config_hash(variables: dict[str, str]) -> str:
    """A pod-template annotation that changes exactly when that component's variables change,
    so editing a gateway setting rolls the gateways and leaves the engines (and their GPUs) alone."""
    return hashlib.sha256(json.dumps(variables, sort_keys=True).encode()).hexdigest()[:16]


def config_map(m3d: M3Deployment, gateway_defaults: GatewayDefaults = GATEWAYS_OWN_DEFAULTS) -> dict[str, Any]:
    # Both components read the whole map; each subcommand only looks at its own M3STACK_<COMMAND>_ prefix.
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(m3d, CONFIG),
        "data": {**engine_environment(m3d), **gateway_environment(m3d, gateway_defaults)},
    }
