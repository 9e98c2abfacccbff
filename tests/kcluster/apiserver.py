"""The test cluster's Kubernetes API server: kmock's emulator with real API semantics.

`TestAPIServer` is a kmock `KubernetesEmulator` (an aiohttp handler that exposes `objects` for
kmock-style assertions and serves kmock reactions on paths it does not own) whose Kubernetes
paths are answered here instead: kmock 0.8 mis-parses `/api/v1/namespaces`,
keeps every request (1,000 pod creates took 122 s) and lacks the semantics real clients need.
This module is only the HTTP layer: routing, content negotiation, lists and watches. What the
verbs do lives in api_lifecycle, storage in api_storage, discovery in api_resources.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock import KubernetesError

from . import api_errors, api_protobuf
from .api_lifecycle import ObjectLifecycle
from .api_patch import PatchError, parse_body
from .api_resources import ResourceRegistry, ResourceType
from .api_selectors import selector_predicate
from .api_storage import ObjectStore, WatchEvent
from .api_tables import to_table

logger = logging.getLogger(__name__)
SERVER_VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0", "platform": "linux/amd64",
                  "gitCommit": "kmock-tandem", "gitTreeState": "clean", "compiler": "gc",
                  "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.23"}
SEED_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
WATCH_POLL_SECONDS = 2.0  # how often an idle watch checks that its client is still there


@dataclass(frozen=True)
class LoggedRequest:
    """One request as the API server saw it: enough to count a client's calls."""

    method: str
    path: str
    query: dict[str, str]
    user_agent: str
    authorization: str  # the header as sent (tests check which credentials a client used)
    at: float  # time.monotonic() on arrival

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass(frozen=True)
class Route:
    """A parsed Kubernetes resource path: /api/v1/namespaces/ns/pods/name/status."""

    group: str
    version: str
    plural: str
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


def parse_path(path: str) -> Route | tuple[str, str] | None:
    """A Route; (group, version) for discovery of a group version; None for other paths."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if not rest:
        return (group, version)
    if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
        namespace, rest = rest[1], rest[2:]
    else:
        namespace = None
    name, subresource = [*rest[1:3], None, None][:2]
    return Route(group, version, rest[0], namespace, name, subresource)


@attrs.define(kw_only=True)
class TestAPIServer(kmock.KubernetesEmulator):
    """An in-memory Kubernetes API server for tests (see the module docstring)."""

    __test__ = False  # not a pytest test class despite the name

    keep_requests: bool = False  # record requests in kmock's `requests` (slow; for debugging)
    history_size: int = 10_000  # watch events kept per resource; older resourceVersions get 410
    registry: ResourceRegistry = attrs.field(factory=ResourceRegistry, init=False)
    store: ObjectStore = attrs.field(init=False)
    lifecycle: ObjectLifecycle = attrs.field(init=False)
    internal_errors: list[Exception] = attrs.field(factory=list, init=False)
    # Every request (method, path, query, client), cheap enough to keep always: tests count
    # the API calls a client makes (`TestCluster.requests`).
    request_log: collections.deque[LoggedRequest] = attrs.field(
        factory=lambda: collections.deque(maxlen=200_000), init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store = ObjectStore(self.history_size, mirror=self._objects)
        self.lifecycle = ObjectLifecycle(self.registry, self.store)
        namespaces = self.registry.get("", "v1", "namespaces")
        for name in SEED_NAMESPACES:
            self.lifecycle.create(namespaces, "", {"metadata": {"name": name}})

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        path = raw.path.rstrip("/") or "/"
        self.request_log.append(LoggedRequest(raw.method, path, dict(raw.query),
                                              raw.headers.get("User-Agent", ""),
                                              raw.headers.get("Authorization", ""),
                                              time.monotonic()))
        if path == "/version":
            return _json(SERVER_VERSION)
        if path == "/api":
            return _json(self.registry.api_versions())
        if path == "/apis":
            return _json(self.registry.api_group_list())
        if path.startswith("/apis/") and path.count("/") == 2:
            group = self.registry.api_group(path.split("/")[2])
            return _json(group) if group else _status(api_errors.no_such_resource())
        if path == "/openapi/v3":
            return _json(self.registry.openapi_v3_root())
        if path.startswith("/openapi/v3/"):
            group_version = parse_path(path.removeprefix("/openapi/v3"))
            document = self.registry.openapi_v3_document(*group_version) if isinstance(
                group_version, tuple) else None
            return _json(document) if document else _status(api_errors.no_such_resource())
        route = parse_path(path)
        if route is None:
            return await super().__call__(raw)  # kmock: user reactions, 404 otherwise
        body = await raw.read()
        if self.keep_requests:
            self._record(raw, body, route)
        try:
            if isinstance(route, tuple):
                listing = self.registry.api_resource_list(*route)
                if listing is None:
                    raise api_errors.no_such_resource()
                return _json(listing)
            return await self._serve(raw, route, body)
        except KubernetesError as error:
            return _status(error)
        except Exception as error:  # a bug here: answer like the real server, keep it for tests
            logger.exception("the test API server failed on %s %s", raw.method, raw.path_qs)
            self.internal_errors.append(error)
            return _status(KubernetesError(500, "InternalError", repr(error), None))

    async def _serve(self, raw: aiohttp.web.BaseRequest, route: Route,
                     body: bytes) -> aiohttp.web.StreamResponse:
        resource = self.registry.get(route.group, route.version, route.plural)
        if resource is None or (route.namespace is not None and not resource.namespaced) or (
                route.subresource and route.subresource not in resource.subresources):
            raise api_errors.no_such_resource()
        if resource.namespaced and route.namespace is None and route.name is not None:
            raise api_errors.no_such_resource()
        params = raw.query
        namespace = route.namespace or ""
        dry_run = params.get("dryRun") == "All"
        method, name, sub = raw.method, route.name, route.subresource
        as_table = "as=Table" in raw.headers.get("Accept", "").split(",")[0] and sub is None

        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._watch(raw, resource, route, as_table)
        if method == "GET" and name is None:
            return _json(self._list(resource, route, params, as_table))
        if method == "GET":
            obj = self.lifecycle.get(resource, namespace, name)
            if sub == "scale":
                return _json(self.lifecycle.scale_of(resource, obj))
            if as_table:
                return _json(to_table(resource, [obj], obj["metadata"]["resourceVersion"],
                                      params.get("includeObject", "PartialObjectMetadata")))
            return _json(self._out(resource, obj))
        if method == "POST" and sub == "binding":
            self.lifecycle.bind(namespace, name, _decode(raw, body))
            return _json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                          "status": "Success", "code": 201}, 201)
        if method == "POST" and name is None:
            obj = self.lifecycle.create(resource, namespace, _decode(raw, body), dry_run)
            return _json(self._out(resource, obj), 201)
        if method == "PUT" and name is not None:
            obj = self.lifecycle.update(resource, namespace, name, _decode(raw, body), sub,
                                        dry_run)
            return _json(self.lifecycle.scale_of(resource, obj) if sub == "scale" else
                         self._out(resource, obj))
        if method == "PATCH" and name is not None:
            content_type = raw.content_type
            try:
                patch = parse_body(content_type, body)
            except PatchError as exc:
                raise api_errors.bad_request(str(exc)) from exc
            obj, created = self.lifecycle.patch(resource, namespace, name, content_type, patch,
                                                sub, params.get("fieldManager", ""), dry_run)
            out = (self.lifecycle.scale_of(resource, obj) if sub == "scale" else
                   self._out(resource, obj))
            return _json(out, 201 if created else 200)
        if method == "DELETE" and name is not None and dry_run:
            return _json(self._out(resource, self.lifecycle.get(resource, namespace, name)))
        if method == "DELETE" and name is not None:
            options = _delete_options(raw, body)
            obj, gone = self.lifecycle.delete(resource, namespace, name, options)
            return _json(self._out(resource, obj), 200 if gone else 202)
        if method == "DELETE":
            return _json(self._delete_collection(resource, route, raw, body))
        raise api_errors.method_not_allowed()

    # -- lists and watches --

    def _matching(self, resource: ResourceType, route: Route, params: Any) -> list[dict]:
        try:
            matches = selector_predicate(params.get("labelSelector"), params.get("fieldSelector"))
        except ValueError as exc:
            raise api_errors.bad_request(f"unable to parse selector: {exc}") from exc
        objects = self.store.list(resource.storage_key, route.namespace)
        objects.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        return [obj for obj in objects if matches(obj)]

    def _list(self, resource: ResourceType, route: Route, params: Any,
              as_table: bool) -> dict[str, Any]:
        items = self._matching(resource, route, params)
        revision = str(self.store.revision)
        if as_table:
            return to_table(resource, items, revision,
                            params.get("includeObject", "PartialObjectMetadata"))
        return {"kind": f"{resource.kind}List", "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": revision},
                "items": [self._out(resource, obj) for obj in items]}

    async def _watch(self, raw: aiohttp.web.BaseRequest, resource: ResourceType, route: Route,
                     as_table: bool) -> aiohttp.web.StreamResponse:
        params = raw.query
        try:
            matches = selector_predicate(params.get("labelSelector"), params.get("fieldSelector"))
        except ValueError as exc:
            raise api_errors.bad_request(f"unable to parse selector: {exc}") from exc
        if route.name is not None:  # a watch on one object's URL: same as a name selector
            named = matches
            matches = lambda obj: obj["metadata"]["name"] == route.name and named(obj)  # noqa: E731
        since = params.get("resourceVersion", "")
        initial = since in ("", "0") or params.get("sendInitialEvents") == "true"
        if not initial and not since.isdigit():
            raise api_errors.bad_request(f"invalid resourceVersion {since!r}")
        timeout = float(params.get("timeoutSeconds") or 0) or None
        deadline = time.monotonic() + timeout if timeout else None
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1")

        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})

        async def send(kind: str, obj: dict[str, Any]) -> None:
            if as_table and kind in ("ADDED", "MODIFIED", "DELETED"):
                obj = to_table(resource, [obj], obj["metadata"]["resourceVersion"],
                               params.get("includeObject", "PartialObjectMetadata"))
            else:
                obj = self._out(resource, obj) if kind != "ERROR" else obj
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        key = resource.storage_key
        try:
            await response.prepare(raw)
            if initial:
                cursor = self.store.revision
                for obj in self._matching(resource, route, {}):
                    if matches(obj):
                        await send("ADDED", obj)
                if params.get("sendInitialEvents") == "true" and bookmarks:
                    await send("BOOKMARK", self._bookmark(resource, cursor, initial_end=True))
            else:
                cursor = int(since)
            while True:
                wakeup = self.store.wakeup(key)
                events = self.store.events_since(key, cursor)
                if events is None:
                    await send("ERROR", api_errors.status_body(KubernetesError(
                        410, "Expired", f"too old resource version: {cursor} "
                        f"({self.store.revision})", None)))
                    break
                for event in events:
                    cursor = event.resource_version
                    kind = _visible_as(event, route.namespace, matches)
                    if kind is not None:
                        await send(kind, event.obj)
                if events:
                    continue
                remaining = deadline - time.monotonic() if deadline else WATCH_POLL_SECONDS
                if remaining <= 0:
                    if bookmarks:
                        await send("BOOKMARK", self._bookmark(resource, self.store.revision))
                    break
                if raw.transport is None or raw.transport.is_closing():
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), min(remaining, WATCH_POLL_SECONDS))
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        return response

    def _bookmark(self, resource: ResourceType, revision: int,
                  initial_end: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"resourceVersion": str(revision)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"kind": resource.kind, "apiVersion": resource.api_version, "metadata": meta}

    def _delete_collection(self, resource: ResourceType, route: Route,
                           raw: aiohttp.web.BaseRequest, body: bytes) -> dict[str, Any]:
        options = _delete_options(raw, body)
        deleted = []
        for obj in self._matching(resource, route, raw.query):
            last, _ = self.lifecycle.delete(resource, obj["metadata"].get("namespace", ""),
                                            obj["metadata"]["name"], options)
            deleted.append(self._out(resource, last))
        return {"kind": f"{resource.kind}List", "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": str(self.store.revision)}, "items": deleted}

    # -- helpers --

    def _out(self, resource: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """An object as the requested version presents it (versions share one storage)."""
        return {**obj, "apiVersion": resource.api_version, "kind": resource.kind}

    def _record(self, raw: aiohttp.web.BaseRequest, body: bytes, route: Route | tuple) -> None:
        fields: dict[str, Any] = {}
        if isinstance(route, Route):
            fields = dict(resource=kmock.resource(route.group, route.version, route.plural),
                          namespace=route.namespace, name=route.name,
                          subresource=route.subresource)
        self._requests.append(kmock.Request(
            id=len(self._requests), method=raw.method, url=raw.url, params=dict(raw.query),
            headers=dict(raw.headers), body=body, text=body.decode(errors="replace"), **fields))


def _visible_as(event: WatchEvent, namespace: str | None, matches: Any) -> str | None:
    """How an event looks to a watch with selectors: objects move in and out of its view."""
    if namespace is not None and event.obj["metadata"].get("namespace", "") != namespace:
        return None
    now_in = matches(event.obj)
    if event.type == "MODIFIED":
        was_in = event.old is not None and matches(event.old)
        return {(True, True): "MODIFIED", (False, True): "ADDED",
                (True, False): "DELETED"}.get((was_in, now_in))
    return event.type if now_in else None


def _decode(raw: aiohttp.web.BaseRequest, body: bytes) -> Any:
    if raw.content_type == api_protobuf.CONTENT_TYPE:
        return api_protobuf.decode(body)
    try:
        return json.loads(body) if body else {}
    except ValueError as exc:
        raise api_errors.bad_request(f"the request body is not valid JSON: {exc}") from exc


def _delete_options(raw: aiohttp.web.BaseRequest, body: bytes) -> dict[str, Any]:
    options = _decode(raw, body) if body else {}
    options = options if isinstance(options, dict) else {}
    for field in ("gracePeriodSeconds", "propagationPolicy", "orphanDependents"):
        if field in raw.query:
            value = raw.query[field]
            options[field] = int(value) if field == "gracePeriodSeconds" else (
                value == "true" if field == "orphanDependents" else value)
    return options


def _json(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(body=json.dumps(body).encode(), status=status,
                                content_type="application/json")


def _status(error: KubernetesError) -> aiohttp.web.Response:
    return _json(api_errors.status_body(error), error.status)

