"""A small, honest in-process fake of the Kubernetes API for the operator's handler tests.

It serves real HTTP on loopback so the operator's real client code runs, and does what the API
server does for the calls the operator makes:
- server-side apply creates an object or replaces the fields the manager sets (the operator is
  the only manager of its children here); a write that changes nothing keeps resourceVersion, and
  `metadata.generation` moves only when the spec does;
- every written child is checked against the Kubernetes 1.30 OpenAPI schemas (422 otherwise);
- kinds of CRDs the cluster lacks answer 404, like an API server without them;
- deleting an object deletes its dependents (the garbage collector, background propagation).
Controllers are not simulated: tests set a Deployment's status themselves.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kubernetes_validate
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ...integration.test_gateway_admission import serve

PATH = re.compile(
    r"^(?P<prefix>/api/v1|/apis/[^/]+/[^/]+)/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status|scale))?$"
)
BUILTIN = {
    ("/apis/apps/v1", "deployments"),
    ("/api/v1", "services"),
    ("/api/v1", "configmaps"),
    ("/api/v1", "serviceaccounts"),
    ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    ("/apis/policy/v1", "poddisruptionbudgets"),
    ("/apis/kvfleet.dev/v1alpha1", "llmdeployments"),
}
MONITORING = {
    "podmonitors.monitoring.coreos.com": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
    "servicemonitors.monitoring.coreos.com": ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    "prometheusrules.monitoring.coreos.com": ("/apis/monitoring.coreos.com/v1", "prometheusrules"),
}
Key = tuple[str, str, str, str]  # (prefix, plural, namespace, name)


def _problem(code: int, message: str) -> JSONResponse:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
    return JSONResponse(body, status_code=code)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeKube:
    def __init__(self, crds: tuple[str, ...] = ()) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.crds = set(crds)
        self.writes: list[tuple[str, str, str]] = []  # (verb, kind, name) of changing writes
        self._versions = itertools.count(1)
        self._uids = itertools.count(1)
        self.app = self._build_app()

    # ---- what tests do to the cluster directly (kubectl, controllers) ----

    def resources(self) -> set[tuple[str, str]]:
        return BUILTIN | {MONITORING[c] for c in self.crds if c in MONITORING}

    def create(self, prefix: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        meta.update(
            uid=f"uid-{next(self._uids)}",
            resourceVersion=str(next(self._versions)),
            generation=1,
            creationTimestamp="2026-11-22T00:00:00Z",
        )
        self.objects[(prefix, plural, meta["namespace"], meta["name"])] = obj
        return obj

    def get(self, prefix: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((prefix, plural, namespace, name))

    def update_spec(self, key: Key, spec: dict[str, Any]) -> dict[str, Any]:
        obj = self.objects[key]
        if obj.get("spec") != spec:
            obj["spec"] = copy.deepcopy(spec)
            obj["metadata"]["generation"] += 1
            obj["metadata"]["resourceVersion"] = str(next(self._versions))
        return obj

    def set_status(self, key: Key, status: dict[str, Any]) -> None:
        self.objects[key]["status"] = copy.deepcopy(status)
        self.objects[key]["metadata"]["resourceVersion"] = str(next(self._versions))

    def delete(self, key: Key) -> None:
        """Delete an object and, like the garbage collector, everything it controls."""
        obj = self.objects.pop(key)
        uid = obj["metadata"]["uid"]
        for other_key, other in list(self.objects.items()):
            refs = other["metadata"].get("ownerReferences") or []
            if other_key in self.objects and any(r.get("uid") == uid for r in refs):
                self.delete(other_key)

    def owned_by(self, uid: str) -> list[dict[str, Any]]:
        return [
            o
            for o in self.objects.values()
            if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])
        ]

    # ---- the HTTP API the operator's client talks to ----

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"major": "1", "minor": "30", "gitVersion": "v1.30.0-fake"}

        @app.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        async def crd(name: str) -> JSONResponse:
            if name not in self.crds:
                return _problem(404, f'customresourcedefinitions "{name}" not found')
            return JSONResponse({"kind": "CustomResourceDefinition", "metadata": {"name": name}})

        @app.api_route("/{path:path}", methods=["GET", "PATCH", "DELETE"])
        async def objects(path: str, request: Request) -> JSONResponse:
            match = PATH.match("/" + path)
            if match is None or (match["prefix"], match["plural"]) not in self.resources():
                return _problem(404, f"the server could not find the requested resource: {path}")
            key = (match["prefix"], match["plural"], match["ns"], match["name"] or "")
            if request.method == "PATCH":
                body = json.loads(await request.body())
                return self._patch(key, match["sub"], request, body)
            if key not in self.objects:
                return _problem(404, f'{match["plural"]} "{match["name"]}" not found')
            if request.method == "GET":
                return JSONResponse(self.objects[key])
            self.delete(key)
            self.writes.append(("delete", match["plural"], key[3]))
            return JSONResponse({"kind": "Status", "status": "Success"})

        return app

    def _patch(
        self, key: Key, subresource: str | None, request: Request, body: dict[str, Any]
    ) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if subresource == "status" and content_type.startswith("application/merge-patch"):
            return self._patch_status(key, body)
        if not content_type.startswith("application/apply-patch"):
            return _problem(415, f"unsupported patch type {content_type}")
        if request.query_params.get("fieldManager") is None:
            return _problem(422, "fieldManager is required for apply requests")
        return self._apply(key, body)

    def _patch_status(self, key: Key, body: dict[str, Any]) -> JSONResponse:
        obj = self.objects.get(key)
        if obj is None:
            return _problem(404, f'"{key[3]}" not found')
        status = merge_patch(obj.get("status") or {}, body.get("status") or {})
        if status != obj.get("status"):
            obj["status"] = status
            obj["metadata"]["resourceVersion"] = str(next(self._versions))
            self.writes.append(("status", key[1], key[3]))
        return JSONResponse(obj)

    def _apply(self, key: Key, body: dict[str, Any]) -> JSONResponse:
        if body.get("metadata", {}).get("name") != key[3]:
            return _problem(400, "the name in the body does not match the URL")
        if not body["apiVersion"].startswith("monitoring.coreos.com/"):
            try:
                kubernetes_validate.validate(body, "1.30.0", strict=True)
            except kubernetes_validate.ValidationError as exc:
                return _problem(422, f"{body['kind']} {key[3]} is invalid: {exc.message}")
        stored = self.objects.get(key)
        if stored is None:
            created = self.create(key[0], key[1], body)
            self.writes.append(("create", key[1], key[3]))
            return JSONResponse(created)
        updated = copy.deepcopy(stored)
        for field, value in body.items():
            if field not in ("metadata", "status"):
                updated[field] = copy.deepcopy(value)
        for field in ("labels", "annotations", "ownerReferences"):
            if field in body["metadata"]:
                updated["metadata"][field] = copy.deepcopy(body["metadata"][field])
        if updated != stored:
            if updated.get("spec") != stored.get("spec"):
                updated["metadata"]["generation"] += 1
            updated["metadata"]["resourceVersion"] = str(next(self._versions))
            self.objects[key] = updated
            self.writes.append(("update", key[1], key[3]))
        return JSONResponse(self.objects[key])


@contextmanager
def running(fake: FakeKube) -> Iterator[str]:
    """The fake API served on loopback; yields its URL."""
    with serve(fake.app) as url:
        yield url
