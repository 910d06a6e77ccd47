"""How the API server reads the values the operator writes into children: resource quantities
(apimachinery's `ParseQuantity`, a parser, not a regex) and label keys and values.

An independent implementation for the fake API (`fake_kube.py`), so the operator's own patterns
in `kvfleet.operator.spec` are checked against it rather than against themselves.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

# apimachinery's error text, regex included (its regex is looser than its parser)
QUANTITY_ERROR = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)
_SUFFIXES = {"", "n", "u", "m", "k", "M", "G", "T", "P", "E"} | {f"{p}i" for p in "KMGTPE"}
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def parse_quantity(text: str) -> float:
    """The quantity's value; ValueError with apimachinery's message when it is none."""
    position, end = 0, len(text)
    if position < end and text[position] in "+-":
        position += 1
    digits_start = position
    while position < end and text[position].isdigit():
        position += 1
    if position < end and text[position] == ".":
        position += 1
        while position < end and text[position].isdigit():
            position += 1
    number = text[digits_start:position]
    if number in ("", "."):
        raise ValueError(QUANTITY_ERROR)
    suffix = text[position:]
    if suffix not in _SUFFIXES and not re.fullmatch(r"[eE][-+]?[0-9]+", suffix):
        raise ValueError(QUANTITY_ERROR)
    value = float(text[:position] or "0")
    return value


def label_value_errors(value: str) -> list[str]:
    errors = []
    if len(value) > 63:
        errors.append("must be no more than 63 characters")
    if value and not _NAME.match(value):
        errors.append(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', "
            "'_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  "
            "or 'my_value',  or '12345', regex used for validation is "
            "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
        )
    return errors


def label_key_errors(key: str) -> list[str]:
    prefix, _, name = key.rpartition("/")
    errors = []
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        errors.append("prefix part must be a lowercase RFC 1123 subdomain")
    if not name or len(name) > 63 or not _NAME.match(name):
        errors.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
            "and end with an alphanumeric character"
        )
    return errors


def _walk(node: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """(path, key, value) of every mapping entry under `node`."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path, key, value
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from _walk(item, f"{path}[{index}]")


def quantity_errors(obj: dict[str, Any]) -> list[str]:
    """Unparseable quantities in resource requests/limits and volume size limits."""
    errors = []
    for path, key, value in _walk(obj, ""):
        quantities: dict[str, Any] = {}
        if key in ("requests", "limits") and path.endswith("resources") and isinstance(value, dict):
            quantities = value
        elif key == "sizeLimit":
            quantities = {"": value}
        for name, quantity in quantities.items():
            try:
                parse_quantity(str(quantity))
            except ValueError as exc:
                where = f"{path}.{key}" + (f"[{name}]" if name else "")
                errors.append(f"{where.lstrip('.')}: {exc}")
    return errors


def label_errors(obj: dict[str, Any]) -> list[str]:
    """Bad keys or values in metadata labels (the object's and its pod template's) and node
    selectors, worded as the server words them."""
    errors = []
    for path, key, value in _walk(obj, ""):
        if key not in ("labels", "nodeSelector", "matchLabels") or not isinstance(value, dict):
            continue
        for label, text in value.items():
            where = f"{path}.{key}".lstrip(".")
            for problem in label_key_errors(label):
                errors.append(f'{where}: Invalid value: "{label}": {problem}')
            for problem in label_value_errors(str(text)):
                errors.append(f'{where}: Invalid value: "{text}": {problem}')
    return errors
