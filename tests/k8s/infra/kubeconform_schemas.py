"""JSON schemas for kubeconform from a running control plane, so manifests validate offline.

kubeconform downloads its schemas from the internet unless told otherwise.  This writes them from
the API server's own OpenAPI v3 documents instead: every built-in kind of this Kubernetes version
and every CRD installed at the time (install the chart's CRDs first), in kubeconform's file layout.
Objects reject unknown fields unless their schema preserves them (what `kubeconform -strict`
expects), nullable fields accept null and int-or-string fields accept both.

    python3 kubeconform_schemas.py RUN_DIR OUT_DIR
    kubeconform -strict -summary -schema-location 'OUT_DIR/{{ .ResourceKind }}{{ .KindSuffix }}.json' FILE...
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import controlplane
from controlplane import ControlPlane

SCHEMA_LOCATION = "{{ .ResourceKind }}{{ .KindSuffix }}.json"


def kind_suffix(group: str, version: str) -> str:
    """kubeconform's {{ .KindSuffix }}: "-v1" for the core group, else "-<first label of group>-<version>"."""
    return f"-{version}" if not group else f"-{group.split('.', maxsplit=1)[0].lower()}-{version}"


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema tightened and completed for a JSON Schema validator."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if (
        "properties" in result
        and "additionalProperties" not in result
        and not result.get("x-kubernetes-preserve-unknown-fields")
    ):
        result["additionalProperties"] = False
    if result.get("nullable") and isinstance(result.get("type"), str):
        result["type"] = [result["type"], "null"]
    if result.get("x-kubernetes-int-or-string") and "type" not in result:
        result["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return result


def _published_paths(plane: ControlPlane, group_versions: Sequence[str], timeout_s: float) -> list[str]:
    """The API server's OpenAPI v3 paths, once every "group/version" listed is among them: a new
    CRD's schema is published a moment after the CRD is Established."""
    wanted = {f"apis/{group_version}" for group_version in group_versions}
    deadline = time.monotonic() + timeout_s
    while True:
        paths = list(plane.get_json("/openapi/v3")["paths"])
        missing = wanted.difference(paths)
        if not missing:
            return paths
        if time.monotonic() > deadline:
            raise TimeoutError(f"the API server published no OpenAPI v3 schema for {sorted(missing)} in {timeout_s}s")
        time.sleep(0.2)


def write_schemas(plane: ControlPlane, out_dir: Path, wait_for: Sequence[str] = (), timeout_s: float = 60) -> int:
    """Writes one file per kind (plus one shared definitions file per group version) into out_dir;
    returns how many kinds it wrote.  wait_for: "group/version"s of just-installed CRDs to wait for."""
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = 0
    for path in _published_paths(plane, wait_for, timeout_s):
        parts = path.split("/")
        if not (path == "api/v1" or (parts[0] == "apis" and len(parts) == 3)):
            continue  # group lists, discovery documents
        group, version = ("", "v1") if path == "api/v1" else (parts[1], parts[2])
        schemas = plane.get_json(f"/openapi/v3/{path}")["components"]["schemas"]
        definitions = f"_{group or 'core'}_{version}.json"
        (out_dir / definitions).write_text(json.dumps({"components": {"schemas": strict(schemas)}}))
        for name, schema in schemas.items():
            for gvk in schema.get("x-kubernetes-group-version-kind", []):
                if (gvk["group"], gvk["version"]) == (group, version):
                    target = out_dir / f"{gvk['kind'].lower()}{kind_suffix(group, version)}.json"
                    target.write_text(json.dumps({"$ref": f"{definitions}#/components/schemas/{name}"}))
                    kinds += 1
    return kinds


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} RUN_DIR OUT_DIR")
    out = Path(sys.argv[2]).resolve()
    count = write_schemas(controlplane.load(Path(sys.argv[1])), out)
    sys.stdout.write(f"{count} kinds; use: kubeconform -strict -schema-location '{out}/{SCHEMA_LOCATION}'\n")
