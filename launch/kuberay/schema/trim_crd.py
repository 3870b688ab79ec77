"""Trim a KubeRay CRD (ray.io_rayjobs.yaml / ray.io_rayclusters.yaml) to the JSON schema our tests check with.

Hardware: none (a text transform). Run it when the manifests or the KubeRay version change:

    python launch/kuberay/schema/trim_crd.py ray.io_rayjobs.yaml     launch/kuberay/schema/rayjob.v1.json
    python launch/kuberay/schema/trim_crd.py ray.io_rayclusters.yaml launch/kuberay/schema/raycluster.v1.json

with the CRD files from ray-project/kuberay, ray-operator/config/crd/bases/, at the tag in VERSION below
(docs/launch.md says which). The full CRD is ~240 KB of OpenAPI, mostly the Kubernetes PodSpec; the trimmed
schema keeps, along the paths our manifests use (KEEP), every object's property names, types, enums,
patterns and `required` lists, and closes those objects (`additionalProperties: false`, as
`kubectl apply --validate=strict` rejects unknown fields). Elsewhere a field keeps only its type.
Dropped: descriptions, defaults, `status`, and CEL rules (`x-kubernetes-validations`; jsonschema cannot run them).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

VERSION = "v1.7.0"
"""The KubeRay release the shipped schemas were trimmed from (tag of ray-project/kuberay)."""

POD = [  # under a PodTemplateSpec (`template`), the fields our manifests set
    "metadata.labels", "spec.nodeSelector", "spec.tolerations[]", "spec.volumes[].emptyDir",
    "spec.volumes[].persistentVolumeClaim", "spec.containers[].env[].valueFrom.secretKeyRef",
    "spec.containers[].ports[]", "spec.containers[].resources.limits", "spec.containers[].resources.requests",
    "spec.containers[].volumeMounts[]",
]
GROUP = ["rayStartParams", "labels", "resources"] + [f"template.{p}" for p in POD]
CLUSTER = (["authOptions", "rayVersion", "enableInTreeAutoscaling"]
           + [f"headGroupSpec.{p}" for p in GROUP] + [f"workerGroupSpecs[].{p}" for p in GROUP])
KEEP = {
    "RayCluster": ["apiVersion", "kind", "metadata"] + [f"spec.{p}" for p in CLUSTER],
    "RayJob": ["apiVersion", "kind", "metadata", "spec.entrypoint", "spec.runtimeEnvYAML"]
              + [f"spec.rayClusterSpec.{p}" for p in CLUSTER],
}
"""Paths (dots between properties, [] for an array's items) along which objects are kept whole."""

SCALAR_KEYS = ("type", "anyOf", "enum", "format", "pattern", "minimum", "maxLength", "minLength", "minItems")


def split(path: str) -> tuple[str, ...]:
    parts: list[str] = []
    for part in path.split("."):
        while part.endswith("[]"):
            part = part[:-2]
            parts += [part, "[]"] if part else ["[]"]
            part = ""
        if part:
            parts.append(part)
    return tuple(parts)


def scalar(node: dict, keys: tuple[str, ...] = SCALAR_KEYS) -> dict:
    """The node's type and constraints; Kubernetes' int-or-string becomes anyOf integer/string."""
    out = {k: node[k] for k in keys if k in node}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def shallow(node: dict) -> dict:
    """A field off our paths: its type (and scalar constraints); an array's items likewise."""
    out = scalar(node)
    if node.get("type") == "array" and "items" in node:
        out["items"] = shallow(node["items"])
    return out


def trim(node: dict, path: tuple[str, ...], keep: list[tuple[str, ...]]) -> dict:
    """`node` at `path`: whole (and closed) if a KEEP path goes through it or ends in it, else shallow."""
    on_path = [k for k in keep if k[:len(path)] == path]
    if not on_path:
        return shallow(node)
    out = scalar(node, SCALAR_KEYS + ("required",))
    if "items" in node:
        out["items"] = trim(node["items"], path + ("[]",), keep)
    if "properties" in node:
        out["properties"] = {name: trim(child, path + (name,), keep)
                             for name, child in sorted(node["properties"].items())}
        out["additionalProperties"] = False
    elif isinstance(node.get("additionalProperties"), dict):  # a map, e.g. limits or rayStartParams
        out["additionalProperties"] = trim(node["additionalProperties"], path + ("*",), [k + ("*",) for k in keep])
    return out


def trimmed_schema(crd: dict) -> dict:
    kind = crd["spec"]["names"]["kind"]
    if kind not in KEEP:
        raise ValueError(f"no KEEP paths for CRD kind {kind!r}; known: {sorted(KEEP)}")
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    if "v1" not in versions:
        raise ValueError(f"{kind} CRD has no v1 version (has {sorted(versions)})")
    root = dict(versions["v1"]["schema"]["openAPIV3Schema"])
    root["properties"] = {k: v for k, v in root["properties"].items() if k != "status"}
    schema = trim(root, (), [split(p) for p in KEEP[kind]])
    schema["properties"]["apiVersion"]["const"] = "ray.io/v1"
    schema["properties"]["kind"]["const"] = kind
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": f"{kind} (ray.io/v1), trimmed from KubeRay {VERSION} "
                     f"ray-operator/config/crd/bases/ray.io_{crd['spec']['names']['plural']}.yaml "
                     "by launch/kuberay/schema/trim_crd.py", **schema}


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: trim_crd.py CRD.yaml OUT.json")
    crd = yaml.safe_load(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(trimmed_schema(crd), indent=1, sort_keys=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
