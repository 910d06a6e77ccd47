"""Triton kernels run on the CPU through Triton's interpreter here (CI has no GPU).

NOTE: the variable must be set before any module defining a kernel is imported; nothing outside
this folder imports the Triton backend on a machine without CUDA.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("torch") is not None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
