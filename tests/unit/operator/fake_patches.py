"""How the API server applies writes the fake serves: JSON merge patches (RFC 7386), JSON
patches (RFC 6902, kopf's finalizer edits), and label selectors on lists and watches."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


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


def json_patch(target: Any, operations: list[dict[str, Any]]) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test); ValueError when an operation fails."""
    out = copy.deepcopy(target)
    for op in operations:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        index: Any = last
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
        if op["op"] == "test" and node[index] != op["value"]:
            raise ValueError(f"test failed at {op['path']}")
        if op["op"] == "remove" or op["op"] == "replace":
            if isinstance(node, list) and op["op"] == "remove":
                node.pop(index)
            elif op["op"] == "remove":
                del node[index]
        if op["op"] == "add" and isinstance(node, list):
            node.insert(index, copy.deepcopy(op["value"]))
        elif op["op"] in ("add", "replace"):
            node[index] = copy.deepcopy(op["value"])
    return out


def selected(obj: Mapping[str, Any], selector: str | None) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (selector or "").split(",")):
        name, equals, value = term.partition("=")
        if equals and labels.get(name.rstrip("!")) != value.lstrip("="):
            return False
        if not equals and name not in labels:
            return False
    return True
