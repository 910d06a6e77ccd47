"""The `kvfleet` command: one entry point for every component's subcommands.

NOTE: this module is what the gateway and operator images run too, so it imports nothing heavy
at module level; each subcommand imports its component when it runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from kvfleet.bench import commands as bench_commands
from kvfleet.cli import serve
from kvfleet.engine.loader import model_cache
from kvfleet.engine.server import commands as engine_commands
from kvfleet.gateway import commands as gateway_commands
from kvfleet.operator import commands as operator_commands

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet: bool = getattr(args, "quiet", False)
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO, format="%(message)s", stream=sys.stderr
    )
    try:
        code: int = args.run(args)
    except (model_cache.ModelCacheError, ValueError) as exc:
        print(f"kvfleet: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvfleet: interrupted", file=sys.stderr)
        return 130
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet",
        description="LLM serving on Kubernetes with its own GPU engine.",
        # `kvfleet gateway @FILE` reads arguments from a file, one per line (the operator
        # mounts the gateway's from a ConfigMap)
        fromfile_prefix_chars="@",
    )
    parser.add_argument("--version", action="version", version=f"kvfleet {_version()}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    _add_models_command(commands)
    serve.add_command(commands)
    engine_commands.add_commands(commands)
    gateway_commands.add_commands(commands)
    operator_commands.add_commands(commands)
    bench_commands.add_commands(commands)
    return parser


def _add_models_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = commands.add_parser(
        "models",
        help="fetch and list models in the local cache ($KVFLEET_HOME)",
        description="The local model cache under $KVFLEET_HOME (default ~/.cache/kvfleet).",
    )
    actions = models.add_subparsers(title="actions", metavar="ACTION", required=True)

    fetch = actions.add_parser("fetch", help="put a verified copy of a built-in model in the cache")
    fetch.add_argument("name", help=f"a built-in alias: {', '.join(model_cache.BUILTIN_MODELS)}")
    fetch.add_argument("--verify", action="store_true", help="re-hash a model already cached")
    fetch.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    fetch.set_defaults(run=_run_models_fetch)

    download = actions.add_parser(
        "download", help="download a model file from a URL (an LLMDeployment's URL source)"
    )
    download.add_argument("url")
    download.add_argument("--output", required=True, help="the file to write (kept if present)")
    download.add_argument("--sha256", help="the file's expected sha256")
    download.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    download.set_defaults(run=_run_models_download)

    listing = actions.add_parser("list", help="list built-in aliases and cached models")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(run=_run_models_list)


def _run_models_fetch(args: argparse.Namespace) -> int:
    model = model_cache.resolve_alias(args.name)
    cache = model_cache.ModelCache(model_cache.kvfleet_home())
    cached, fetched = cache.fetch(model, verify=args.verify, progress=not args.quiet)
    state = "fetched" if fetched else ("verified" if args.verify else "already cached")
    print(f"{cached.alias}: {state}, {_megabytes(cached.size)}, sha256 {cached.sha256[:12]}…")
    print(cached.path)
    return 0


def _run_models_download(args: argparse.Namespace) -> int:
    output = Path(args.output)
    fetched = model_cache.download_url(args.url, output, args.sha256, progress=not args.quiet)
    print(f"{output}: {'downloaded' if fetched else 'already present'}")
    return 0


def _run_models_list(args: argparse.Namespace) -> int:
    cache = model_cache.ModelCache(model_cache.kvfleet_home())
    entries = cache.entries()
    if args.json:
        rows = [
            {
                "alias": e.alias,
                "format": e.file_format,
                "size": e.size,
                "status": "cached" if e.cached else "not fetched",
                "path": str(e.cached.path) if e.cached else None,
                "description": e.description,
            }
            for e in entries
        ]
        print(json.dumps({"home": str(cache.root), "models": rows}, indent=2))
        return 0
    print(f"model cache: {cache.root}")
    print(f"{'ALIAS':<12}{'FORMAT':<8}{'SIZE':>10}  {'STATUS':<13}PATH")
    for e in entries:
        status = "cached" if e.cached else "not fetched"
        path = str(e.cached.path) if e.cached else f"(kvfleet models fetch {e.alias})"
        print(f"{e.alias:<12}{e.file_format:<8}{_megabytes(e.size):>10}  {status:<13}{path}")
    return 0


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _version() -> str:
    try:
        return importlib.metadata.version("kvfleet")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
