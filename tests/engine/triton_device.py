"""Where the Triton kernel tests run: on CUDA when there is one, else on the CPU under
Triton's interpreter (TRITON_INTERPRET=1, set here before triton is first imported).
Importing this skips the importing test module when triton is missing, or when there is
no GPU and the interpreter was turned off."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and the Triton interpreter is off", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
