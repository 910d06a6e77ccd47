"""`kvfleet gateway` and the engine's LoRA flags: bad arguments stop with a clear message."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvfleet.engine.server import commands as server_cli
from kvfleet.gateway import commands as gateway_cli
from kvfleet.gateway.routing.snapshot import Policy


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    gateway_cli.add_commands(commands)
    server_cli.add_commands(commands)
    return parser.parse_args(argv)


def test_gateway_settings_from_flags(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"id": "a", "sha256": "00"}]}))
    args = parse(
        "gateway",
        "--replica",
        "http://e:1",
        "--policy",
        "round-robin",
        "--api-keys",
        str(keys),
        "--lora-adapter",
        "sql=/a/sql",
        "--autoscale",
        "llm/chat",
        "--max-replicas",
        "6",
    )
    settings = gateway_cli.settings_from(args)
    assert settings.replicas == ("http://e:1",)
    assert settings.policy is Policy.ROUND_ROBIN
    assert settings.adapters == (("sql", "/a/sql"),)
    assert settings.autoscale is not None
    assert settings.autoscale[:2] == ("llm", "chat")
    assert settings.autoscale[2].max_replicas == 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gateway"], "at least one --replica"),
        (["gateway", "--discover", "k8s"], "needs --service"),
        (["gateway", "--replica", "u", "--lora-adapter", "sql"], "NAME=PATH"),
        (["gateway", "--replica", "u", "--autoscale", "chat"], "NAMESPACE/NAME"),
        (
            ["gateway", "--replica", "u", "--autoscale", "a/b", "--min-replicas", "5"],
            "min_replicas",
        ),
        (["gateway", "--replica", "u", "--api-keys", "/nowhere.json"], "cannot read the API keys"),
        (["gateway", "--replica", "u", "--activation-timeout", "-1"], "must be positive"),
        (["gateway", "--replica", "u", "--activation-timeout", "nan"], "must be positive"),
    ],
)
def test_bad_gateway_flags_stop_with_a_reason(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        gateway_cli.settings_from(parse(*argv))


def test_bad_lora_flags_stop_with_a_reason() -> None:
    with pytest.raises(SystemExit, match="--lora-modules takes NAME=PATH"):
        server_cli._settings(parse("engine", "--lora-modules", "sql"), "smollm2")
    with pytest.raises(SystemExit, match="lora_modules needs enable_lora"):
        server_cli._settings(parse("engine", "--lora-modules", "sql=/a"), "smollm2")
    with pytest.raises(SystemExit, match="max_cpu_loras"):
        server_cli._settings(
            parse("engine", "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"), "smollm2"
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["gateway", "--port", "99999"],
        ["engine", "--port", "0"],
        ["serve", "--port", "70000"],
        ["serve", "--first-engine-port", "x"],
        ["serve", "--replicas", "0"],
    ],
)
def test_a_port_outside_1_to_65535_or_no_replica_is_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # (uvicorn took --port 99999 and said it listened there)
    from kvfleet.cli.main import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    said = capsys.readouterr().err
    assert (
        "must be at most 65535" in said
        or "must be at least 1, got 0" in said
        or ("not an integer: 'x'" in said)
    )


def test_engine_ports_past_65535_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfleet.cli.main import main

    assert main(["serve", "--first-engine-port", "65535", "--replicas", "2"]) == 1
    assert "leaves no port for engine 2" in capsys.readouterr().err
