"""Hugging Face folders: weights from (sharded) safetensors files."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
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


# A fused checkpoint tensor's parts: (name, first row, rows) each
FusedParts = Callable[[str], list[tuple[str, int, int]] | None]


def iterate_safetensors_weights(
    folder: Path,
    slice_for: Callable[[str], tuple[int, int, int] | None] | None = None,
    fused_parts: FusedParts | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor; with `slice_for`, only the (dim, start, length) slice
    it names is read from the file (tensor parallelism); a tensor `fused_parts` splits comes
    as its parts (each read, then sliced)."""
    for file in safetensors_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                parts = fused_parts(name) if fused_parts is not None else None
                if parts is not None:
                    lazy = f.get_slice(name)
                    for part_name, first, rows in parts:
                        piece = lazy[first : first + rows]
                        cut = slice_for(part_name) if slice_for is not None else None
                        yield part_name, piece if cut is None else piece.narrow(*cut)
                    continue
                part = slice_for(name) if slice_for is not None else None
                if part is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = part
                lazy = f.get_slice(name)
                shape = lazy.get_shape()
                if len(shape) <= dim or (shape[dim] == 1 and length != 1):
                    yield name, f.get_tensor(name)  # (a scale shared by every row: whole)
                    continue
                index = (slice(None),) * dim + (slice(start, start + length),)
                yield name, lazy[index]
