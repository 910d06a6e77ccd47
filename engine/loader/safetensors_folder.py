"""Hugging Face folders: weights from (sharded) safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(folder: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(
            f"{folder}: safetensors files missing ({', '.join(missing) or 'none found'})"
        )
    return files


def iterate_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)
