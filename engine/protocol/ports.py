"""The port flags of the servers (engine, gateway, `kvfleet serve`): light, for argument parsing."""

from __future__ import annotations

import argparse


def tcp_port(text: str) -> int:
    """An argparse type for a port to listen on: 1 to 65535 (uvicorn took 99999 and said it
    listened there)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is from 1 to 65535, got {port}")
    return port
