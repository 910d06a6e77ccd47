"""Argparse types the commands share (servers, gateway, benchmarks): light, for parsing only."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_in(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from `minimum` (to `maximum`), a usage error otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    return parse


MAX_PORT = 65535
# A port to listen on (uvicorn took 99999 and said it listened there).
tcp_port = int_in(1, MAX_PORT)
