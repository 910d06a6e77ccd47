"""A small, strict in-process fake of the Kubernetes API for the operator's and the gateway's
tests.

It serves real HTTP on loopback so the real clients run (the operator's, kopf's, the Kubernetes
Python client's), and does what the API server does for the calls they make:
- authentication by bearer token and RBAC on every request (`fake_rbac.py`; admission and
  validation in `fake_admission.py`, patches in `fake_patches.py`): the operator holds
  the rules of manifests/operator/clusterrole.yaml, a ServiceAccount the rules of the Roles its
  RoleBindings name; the OwnerReferencesPermissionEnforcement plugin and the escalation check
  on Role writes; 403 with the server's wording otherwise;
- server-side apply creates an object or replaces the fields the manager sets; a write that
  changes nothing keeps resourceVersion, `metadata.generation` moves only when the spec does;
  `dryRun=All` answers without storing;
- every written child is checked against the Kubernetes 1.30 OpenAPI schemas with unknown fields
  refused (422), its quantities parsed as apimachinery parses them (500, as a real server answered
  for "1.2.3Gi") and its label keys and values checked (422); a Deployment's selector is immutable;
- the status of an LLMDeployment changes only through `/status` (a write to the main resource
  drops it), its `/scale` reads and writes spec.replicas;
- discovery, list and watch (with label selectors and resource versions) for kopf; Events and
  Leases (create, and replace with optimistic concurrency: 409 on a stale resourceVersion);
- kinds of CRDs the cluster lacks answer 404; deleting an object deletes its dependents (the
  garbage collector) unless finalizers hold it, then it only gets a deletionTimestamp.
Controllers are not simulated: tests set a Deployment's status themselves.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ...integration.test_gateway_admission import serve
from .fake_admission import admission_error
from .fake_patches import json_patch, merge_patch, selected
from .fake_rbac import (
    OPERATOR_SUBJECT,
    Attributes,
    allows,
    operator_cluster_role,
)
from .fake_resources import (
    BUILTIN,
    CRD_PREFIX,
    MONITORING,
    MONITORING_KINDS,
    Resources,
    group_list,
    resource_list,
)

PATH = re.compile(
    r"^(?P<prefix>/api/v1|/apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
    r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status|scale))?$"
)
Key = tuple[str, str, str, str]  # (prefix, plural, namespace or "", name)


def _problem(code: int, message: str, reason: str = "") -> JSONResponse:
    reasons = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict"}
    reasons |= {415: "UnsupportedMediaType", 422: "Invalid", 500: "InternalError"}
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason or reasons.get(code, ""),
        "code": code,
    }
    return JSONResponse(body, status_code=code)


@dataclass
class WatchEvent:
    version: int
    type: str  # ADDED, MODIFIED, DELETED
    key: Key
    obj: dict[str, Any]


@dataclass
class FakeKube:
    crds: set[str] = field(default_factory=set)
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    writes: list[tuple[str, str, str]] = field(default_factory=list)  # (verb, plural, name)
    denied: list[str] = field(default_factory=list)  # every 403 answered, as its message
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path?query)
    # bearer token -> subject; requests without a token act as the operator's ServiceAccount
    tokens: dict[str, str] = field(default_factory=dict)
    operator_rules: list[dict[str, Any]] = field(default_factory=operator_cluster_role)
    history: list[WatchEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.crds = set(self.crds)
        self._versions = itertools.count(1)
        self._uids = itertools.count(1)
        self._lock = threading.RLock()
        self.closing = False
        self.app = self._build_app()
        for crd in ["llmdeployments.kvfleet.dev", *sorted(self.crds)]:
            self.create(
                CRD_PREFIX,
                "customresourcedefinitions",
                {"kind": "CustomResourceDefinition", "metadata": {"name": crd}},
            )

    # ---- what tests do to the cluster directly (kubectl, controllers) ----

    def resources(self) -> Resources:
        found = dict(BUILTIN)
        for crd in self.crds:
            if crd in MONITORING:
                prefix, plural = MONITORING[crd]
                found[(prefix, plural)] = (MONITORING_KINDS[plural], True)
        return found

    def _record(self, kind: str, key: Key, obj: dict[str, Any]) -> None:
        version = next(self._versions)
        obj["metadata"]["resourceVersion"] = str(version)
        self.history.append(WatchEvent(version, kind, key, copy.deepcopy(obj)))

    def create(self, prefix: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            obj = copy.deepcopy(obj)
            meta = obj["metadata"]
            meta.update(
                uid=f"uid-{next(self._uids)}",
                generation=1,
                creationTimestamp="2026-11-22T00:00:00Z",
            )
            kind, _ = self.resources().get((prefix, plural), (obj.get("kind", ""), True))
            obj.setdefault("kind", kind)
            obj.setdefault("apiVersion", prefix.removeprefix("/apis/").removeprefix("/api/"))
            key = (prefix, plural, meta.get("namespace", ""), meta["name"])
            self.objects[key] = obj
            self._record("ADDED", key, obj)
            return obj

    def add_crd(self, name: str) -> None:
        """Install a CRD (e.g. the Prometheus operator's) while everything runs."""
        with self._lock:
            self.crds.add(name)
            self.create(
                CRD_PREFIX,
                "customresourcedefinitions",
                {"kind": "CustomResourceDefinition", "metadata": {"name": name}},
            )

    def get(self, prefix: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((prefix, plural, namespace, name))

    def update_spec(self, key: Key, spec: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            obj = self.objects[key]
            if obj.get("spec") != spec:
                obj["spec"] = copy.deepcopy(spec)
                obj["metadata"]["generation"] += 1
                self._record("MODIFIED", key, obj)
            return obj

    def set_status(self, key: Key, status: dict[str, Any]) -> None:
        with self._lock:
            self.objects[key]["status"] = copy.deepcopy(status)
            self._record("MODIFIED", key, self.objects[key])

    def delete(self, key: Key) -> None:
        """`kubectl delete`: objects held by finalizers only get a deletionTimestamp; the others
        go, and like the garbage collector, everything they control with them."""
        with self._lock:
            obj = self.objects[key]
            if obj["metadata"].get("finalizers"):
                if "deletionTimestamp" not in obj["metadata"]:
                    obj["metadata"]["deletionTimestamp"] = "2026-11-22T01:00:00Z"
                    self._record("MODIFIED", key, obj)
                return
            self._remove(key)

    def _remove(self, key: Key) -> None:
        obj = self.objects.pop(key)
        self._record("DELETED", key, obj)
        uid = obj["metadata"]["uid"]
        for other_key, other in list(self.objects.items()):
            refs = other["metadata"].get("ownerReferences") or []
            if other_key in self.objects and any(r.get("uid") == uid for r in refs):
                self._remove(other_key)

    def owned_by(self, uid: str) -> list[dict[str, Any]]:
        return [
            o
            for o in self.objects.values()
            if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])
        ]

    def events_for(self, name: str) -> list[dict[str, Any]]:
        """Events about the object `name`, oldest first (what `kubectl describe` lists)."""
        return [
            o
            for (prefix, plural, _, _), o in self.objects.items()
            if (prefix, plural) == ("/api/v1", "events")
            and o.get("involvedObject", {}).get("name") == name
        ]

    # ---- who may do what ----

    def rules_of(self, subject: str) -> list[dict[str, Any]]:
        if subject == OPERATOR_SUBJECT:
            return self.operator_rules
        rules: list[dict[str, Any]] = []
        _, _, namespace, account = [*subject.split(":"), "", "", "", ""][:4]
        for (prefix, plural, ns, _), binding in list(self.objects.items()):
            if (prefix, plural) != ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"):
                continue
            subjects = binding.get("subjects") or []
            named = any(
                s.get("name") == account and s.get("namespace") == namespace for s in subjects
            )
            role = self.objects.get(
                ("/apis/rbac.authorization.k8s.io/v1", "roles", ns, binding["roleRef"]["name"])
            )
            if named and role is not None:
                rules += [{**r, "_namespace": ns} for r in role.get("rules") or []]
        return rules

    def _authorize(self, subject: str, attributes: Attributes) -> JSONResponse | None:
        rules = [
            r for r in self.rules_of(subject) if r.get("_namespace") in (None, attributes.namespace)
        ]
        if allows(rules, attributes):
            return None
        message = attributes.describe(subject)
        self.denied.append(message)
        return _problem(403, message)

    # ---- the HTTP API ----

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"major": "1", "minor": "30", "gitVersion": "v1.30.0-fake"}

        @app.get("/api")
        async def core_versions() -> dict[str, Any]:
            return {"kind": "APIVersions", "versions": ["v1"]}

        @app.get("/apis")
        async def groups() -> dict[str, Any]:
            return group_list(self.resources())

        @app.api_route("/{path:path}", methods=["GET", "PATCH", "DELETE", "POST", "PUT"])
        async def objects(path: str, request: Request) -> Response:
            query = f"?{request.url.query}" if request.url.query else ""
            self.requests.append((request.method, f"/{path}{query}"))
            subject = self._subject(request)
            if subject is None:
                return _problem(401, "Unauthorized", "Unauthorized")
            resources = self.resources()
            if request.method == "GET" and any(f"/{path}" == p for p, _ in resources):
                return JSONResponse(resource_list(resources, f"/{path}"))
            match = PATH.match("/" + path)
            if match is None or (match["prefix"], match["plural"]) not in resources:
                return _problem(404, f"the server could not find the requested resource: {path}")
            body = await request.body()
            return await self._serve(match, request, subject, body)

        return app

    def _subject(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        if not header:
            return OPERATOR_SUBJECT
        token = header.removeprefix("Bearer ").strip()
        return self.tokens.get(token, OPERATOR_SUBJECT if token == "operator" else None)

    async def _serve(  # noqa: PLR0911 (one answer per verb, as the server's handlers)
        self, match: re.Match[str], request: Request, subject: str, raw: bytes
    ) -> Response:
        prefix, plural, namespace = match["prefix"], match["plural"], match["ns"]
        name, sub = match["name"], match["sub"]
        group = prefix.removeprefix("/apis/").split("/")[0] if prefix.startswith("/apis/") else ""
        watching = request.query_params.get("watch") in ("true", "1")
        verb = {
            "GET": "watch" if watching else ("get" if name else "list"),
            "PATCH": "patch",
            "DELETE": "delete",
            "POST": "create",
            "PUT": "update",
        }[request.method]
        resource = f"{plural}/{sub}" if sub else plural
        denied = self._authorize(subject, Attributes(verb, group, resource, namespace, name))
        if denied is not None:
            return denied
        if request.method == "GET" and not name:
            if watching:
                return self._watch(prefix, plural, namespace, request)
            return self._list(prefix, plural, namespace, request.query_params.get("labelSelector"))
        body = json.loads(raw) if raw else {}
        with self._lock:
            if request.method == "POST":
                return self._create(prefix, plural, namespace or "", body, subject)
            key = (prefix, plural, namespace or "", name)
            if request.method == "PATCH":
                return self._patch(key, sub, request, body, subject)
            if request.method == "PUT":
                return self._replace(key, body)
            if key not in self.objects:
                return _problem(404, f'{plural} "{name}" not found', "NotFound")
            if request.method == "GET":
                if sub == "scale":
                    return JSONResponse(self._scale_of(self.objects[key]))
                return JSONResponse(self.objects[key])
            self.delete(key)
            self.writes.append(("delete", plural, name))
            return JSONResponse({"kind": "Status", "status": "Success"})

    def _list(
        self, prefix: str, plural: str, namespace: str | None, selector: str | None
    ) -> JSONResponse:
        with self._lock:
            items = [
                o
                for (p, r, ns, _), o in self.objects.items()
                if (p, r) == (prefix, plural) and namespace in (None, ns) and selected(o, selector)
            ]
            version = str(self.history[-1].version if self.history else 0)
        body = {"kind": "List", "metadata": {"resourceVersion": version}, "items": items}
        return JSONResponse(copy.deepcopy(body))

    def _watch(
        self, prefix: str, plural: str, namespace: str | None, request: Request
    ) -> StreamingResponse:
        since = int(request.query_params.get("resourceVersion") or 0)
        selector = request.query_params.get("labelSelector")
        timeout = float(request.query_params.get("timeoutSeconds") or 3600)

        async def stream() -> AsyncIterator[bytes]:
            seen = since
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while not self.closing and loop.time() < deadline:
                with self._lock:
                    fresh = [e for e in self.history if e.version > seen]
                for event in fresh:
                    seen = event.version
                    p, r, ns, _ = event.key
                    wanted = (p, r) == (prefix, plural) and namespace in (None, ns)
                    if wanted and selected(event.obj, selector):
                        line = {"type": event.type, "object": event.obj}
                        yield (json.dumps(line) + "\n").encode()
                await asyncio.sleep(0.02)

        return StreamingResponse(stream(), media_type="application/json")

    def _create(
        self, prefix: str, plural: str, namespace: str, body: dict[str, Any], subject: str
    ) -> JSONResponse:
        meta = body.setdefault("metadata", {})
        if "generateName" in meta and "name" not in meta:
            meta["name"] = f"{meta['generateName']}{next(self._uids):05d}"
        meta.setdefault("namespace", namespace)
        key = (prefix, plural, namespace, meta["name"])
        if key in self.objects:
            return _problem(409, f'{plural} "{meta["name"]}" already exists', "AlreadyExists")
        invalid = self._invalid(body, None, subject, namespace)
        if invalid is not None:
            return invalid
        created = self.create(prefix, plural, body)
        self.writes.append(("create", plural, meta["name"]))
        return JSONResponse(created, status_code=201)

    def _replace(self, key: Key, body: dict[str, Any]) -> JSONResponse:
        """PUT with optimistic concurrency: a stale resourceVersion is a 409 Conflict."""
        stored = self.objects.get(key)
        if stored is None:
            return _problem(404, f'{key[1]} "{key[3]}" not found', "NotFound")
        given = body.get("metadata", {}).get("resourceVersion")
        if given is not None and given != stored["metadata"]["resourceVersion"]:
            return _problem(
                409,
                f'Operation cannot be fulfilled on {key[1]} "{key[3]}": the object has been '
                "modified; please apply your changes to the latest version and try again",
            )
        updated = copy.deepcopy(body)
        updated["metadata"] = {
            **stored["metadata"],
            **{k: v for k, v in body["metadata"].items() if k in ("labels", "annotations")},
        }
        self.objects[key] = updated
        self._record("MODIFIED", key, updated)
        self.writes.append(("update", key[1], key[3]))
        return JSONResponse(updated)

    def _patch(  # noqa: PLR0911 (one answer per patch type)
        self,
        key: Key,
        subresource: str | None,
        request: Request,
        body: dict[str, Any],
        subject: str,
    ) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        merging = content_type.startswith("application/merge-patch")
        if merging and subresource == "status":
            return self._patch_status(key, body)
        if merging and subresource == "scale":
            return self._patch_scale(key, body)
        if merging:
            return self._merge(key, body)
        if content_type.startswith("application/json-patch"):
            obj = self.objects.get(key)
            if obj is None:
                return _problem(404, f'"{key[3]}" not found', "NotFound")
            try:
                patched = json_patch(obj, body)  # type: ignore[arg-type]
            except (KeyError, IndexError, ValueError) as exc:
                return _problem(422, f"the JSON patch failed: {exc}")
            return self._update(key, obj, {**patched, "status": obj.get("status")})
        if not content_type.startswith("application/apply-patch"):
            return _problem(415, f"unsupported patch type {content_type}")
        if request.query_params.get("fieldManager") is None:
            return _problem(422, "fieldManager is required for apply requests")
        dry_run = request.query_params.get("dryRun") == "All"
        return self._apply(key, body, subject, dry_run)

    def _patch_status(self, key: Key, body: dict[str, Any]) -> JSONResponse:
        obj = self.objects.get(key)
        if obj is None:
            return _problem(404, f'"{key[3]}" not found', "NotFound")
        status = merge_patch(obj.get("status") or {}, body.get("status") or {})
        if status != obj.get("status"):
            obj["status"] = status
            self._record("MODIFIED", key, obj)
            self.writes.append(("status", key[1], key[3]))
        return JSONResponse(obj)

    def _scale_of(self, obj: dict[str, Any]) -> dict[str, Any]:
        status = obj.get("status") or {}
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "resourceVersion")},
            "spec": {"replicas": obj["spec"].get("replicas", 1)},
            "status": {
                "replicas": status.get("replicas", 0),
                "selector": status.get("selector", ""),
            },
        }

    def _patch_scale(self, key: Key, body: dict[str, Any]) -> JSONResponse:
        obj = self.objects.get(key)
        if obj is None:
            return _problem(404, f'"{key[3]}" not found', "NotFound")
        replicas = (body.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            return _problem(422, f"spec.replicas: Invalid value: {replicas!r}")
        if obj["spec"].get("replicas") != replicas:
            obj["spec"]["replicas"] = replicas
            obj["metadata"]["generation"] += 1
            self._record("MODIFIED", key, obj)
            self.writes.append(("scale", key[1], key[3]))
        return JSONResponse(self._scale_of(obj))

    def _merge(self, key: Key, body: dict[str, Any]) -> JSONResponse:
        """A merge patch of the main resource: metadata and spec; status is dropped, as the
        server drops it where the status subresource is enabled."""
        obj = self.objects.get(key)
        if obj is None:
            return _problem(404, f'"{key[3]}" not found', "NotFound")
        patch = {k: v for k, v in body.items() if k != "status"}
        return self._update(key, obj, merge_patch(obj, patch))

    def _update(self, key: Key, obj: dict[str, Any], updated: dict[str, Any]) -> JSONResponse:
        if updated.get("status") is None:
            updated.pop("status", None)
        if updated != obj:
            if updated.get("spec") != obj.get("spec"):
                updated["metadata"]["generation"] += 1
            self.objects[key] = updated
            self._record("MODIFIED", key, updated)
            self.writes.append(("patch", key[1], key[3]))
            gone = updated["metadata"].get("deletionTimestamp")
            if gone and not updated["metadata"].get("finalizers"):
                self._remove(key)  # the last finalizer went: deletion completes
        return JSONResponse(updated)

    def _invalid(
        self,
        body: dict[str, Any],
        stored: dict[str, Any] | None,
        subject: str,
        namespace: str,
    ) -> JSONResponse | None:
        """Admission and validation of a write, as the server runs them."""
        refused = admission_error(self.rules_of(subject), subject, body, stored, namespace)
        if refused is None:
            return None
        code, message = refused
        if code == 403:
            self.denied.append(message)
        return _problem(code, message)

    def _apply(self, key: Key, body: dict[str, Any], subject: str, dry_run: bool) -> JSONResponse:
        if body.get("metadata", {}).get("name") != key[3]:
            return _problem(400, "the name in the body does not match the URL")
        stored = self.objects.get(key)
        if stored is None:
            denied = self._authorize(
                subject,
                Attributes("create", _group(key[0]), key[1], key[2] or None, key[3]),
            )
            if denied is not None:
                return denied
        invalid = self._invalid(body, stored, subject, key[2])
        if invalid is not None:
            return invalid
        if stored is None:
            if dry_run:
                return JSONResponse(body, status_code=201)
            created = self.create(key[0], key[1], body)
            self.writes.append(("create", key[1], key[3]))
            return JSONResponse(created, status_code=201)
        updated = copy.deepcopy(stored)
        for name, value in body.items():
            if name not in ("metadata", "status"):
                updated[name] = copy.deepcopy(value)
        for name in ("labels", "annotations", "ownerReferences"):
            if name in body["metadata"]:
                updated["metadata"][name] = copy.deepcopy(body["metadata"][name])
        if updated != stored and not dry_run:
            if updated.get("spec") != stored.get("spec"):
                updated["metadata"]["generation"] += 1
            self.objects[key] = updated
            self._record("MODIFIED", key, updated)
            self.writes.append(("update", key[1], key[3]))
        return JSONResponse(updated if dry_run else self.objects[key])


def _group(prefix: str) -> str:
    return prefix.removeprefix("/apis/").split("/")[0] if prefix.startswith("/apis/") else ""


@contextmanager
def running(fake: FakeKube) -> Iterator[str]:
    """The fake API served on loopback; yields its URL."""
    fake.closing = False
    try:
        with serve(fake.app) as url:
            yield url
            fake.closing = True  # ends open watch streams so the server can stop
    finally:
        fake.closing = True
