"""In-memory storage with Kubernetes' consistency model, and the event history watches replay.

kmock stores objects without resourceVersions and streams every watcher everything from the
start. Controllers (kopf, the router's pod watch, our kubelet) depend on the real model: one
global, monotonically increasing resourceVersion stamped on every write, lists that report
the version they reflect, and watches that resume from a version by replaying only newer
events from a bounded per-resource history, answering 410 Gone once it was compacted away.

Every stored dict is replaced, never mutated, so events can hold references to snapshots.
Objects are mirrored into kmock's ``objects`` array for kmock-style assertions in tests.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import kmock

StorageKey = tuple[str, str]  # (group, plural): all versions of a resource share one storage
ObjectRef = tuple[StorageKey, str, str]  # (storage key, namespace or "", name)


@dataclass(frozen=True)
class WatchEvent:
    resource_version: int
    type: str  # ADDED, MODIFIED or DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None  # the state before, so watches with selectors see transitions


class ObjectStore:
    """Objects by resource, namespace and name; uid and owner indexes; watch history."""

    def __init__(self, history_size: int = 10_000, mirror: kmock.ObjectsArray | None = None):
        self.revision = 0
        self._history_size = history_size
        self._objects: dict[StorageKey, dict[tuple[str, str], dict[str, Any]]] = defaultdict(dict)
        self._by_uid: dict[str, ObjectRef] = {}
        self._dependents: dict[str, set[ObjectRef]] = defaultdict(set)
        self._history: dict[StorageKey, deque[WatchEvent]] = defaultdict(deque)
        self._compacted: dict[StorageKey, int] = defaultdict(int)
        self._wakeups: dict[StorageKey, asyncio.Event] = defaultdict(asyncio.Event)
        self._mirror = mirror

    def get(self, key: StorageKey, namespace: str, name: str) -> dict[str, Any] | None:
        return self._objects[key].get((namespace, name))

    def list(self, key: StorageKey, namespace: str | None = None) -> list[dict[str, Any]]:
        objects = self._objects[key]
        if namespace is None:
            return list(objects.values())
        return [obj for (ns, _), obj in objects.items() if ns == namespace]

    def find_uid(self, uid: str) -> ObjectRef | None:
        return self._by_uid.get(uid)

    def dependents(self, owner_uid: str) -> list[ObjectRef]:
        return sorted(self._dependents.get(owner_uid, ()))

    def put(self, key: StorageKey, obj: dict[str, Any], event_type: str) -> dict[str, Any]:
        """Store a new state (ADDED or MODIFIED) with a fresh resourceVersion."""
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        namespace, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
        old = self._objects[key].get((namespace, name))
        if old is not None:
            self._unindex(key, old)
        self._objects[key][(namespace, name)] = obj
        self._index(key, obj)
        self._record(key, WatchEvent(self.revision, event_type, obj, old))
        return obj

    def remove(self, key: StorageKey, obj: dict[str, Any]) -> dict[str, Any]:
        """Drop an object; its DELETED event carries the deletion's resourceVersion."""
        namespace, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
        old = self._objects[key].pop((namespace, name))
        self._unindex(key, old)
        self.revision += 1
        gone = {**old, "metadata": {**old["metadata"], "resourceVersion": str(self.revision)}}
        self._record(key, WatchEvent(self.revision, "DELETED", gone, old))
        return gone

    def events_since(self, key: StorageKey, revision: int) -> list[WatchEvent] | None:
        """Events newer than `revision`, or None when the history no longer reaches back."""
        if revision < self._compacted[key]:
            return None
        history = self._history[key]
        if not history or history[-1].resource_version <= revision:
            return []
        return [event for event in history if event.resource_version > revision]

    def wakeup(self, key: StorageKey) -> asyncio.Event:
        """An event set on the next write to this resource (take it before reading history)."""
        return self._wakeups[key]

    def _record(self, key: StorageKey, event: WatchEvent) -> None:
        history = self._history[key]
        history.append(event)
        while len(history) > self._history_size:
            self._compacted[key] = history.popleft().resource_version
        wakeup = self._wakeups.pop(key, None)
        if wakeup is not None:
            wakeup.set()
        if self._mirror is not None:
            self._mirror_event(key, event)

    def _index(self, key: StorageKey, obj: dict[str, Any]) -> None:
        ref = (key, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        self._by_uid[obj["metadata"]["uid"]] = ref
        for owner in obj["metadata"].get("ownerReferences") or ():
            self._dependents[owner.get("uid", "")].add(ref)

    def _unindex(self, key: StorageKey, obj: dict[str, Any]) -> None:
        ref = (key, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        self._by_uid.pop(obj["metadata"]["uid"], None)
        for owner in obj["metadata"].get("ownerReferences") or ():
            dependents = self._dependents.get(owner.get("uid", ""))
            if dependents is not None:
                dependents.discard(ref)
                if not dependents:
                    del self._dependents[owner["uid"]]

    def _mirror_event(self, key: StorageKey, event: WatchEvent) -> None:
        assert self._mirror is not None
        version = event.obj.get("apiVersion", "v1").rpartition("/")[2]
        resource = kmock.resource(key[0], version, key[1])
        ident = (resource, event.obj["metadata"].get("namespace") or None,
                 event.obj["metadata"]["name"])
        if event.type == "DELETED":
            self._mirror[ident].delete()
        elif ident in self._mirror:
            self._mirror[ident].history.append(event.obj)
        else:
            self._mirror[ident] = event.obj
