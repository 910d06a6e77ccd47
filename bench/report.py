"""How every benchmark hands back its result: JSON on stdout, and into a file if asked."""

from __future__ import annotations

import json
from typing import Any


def emit(result: dict[str, Any], path: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
