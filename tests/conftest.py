"""Shared test setup.

Triton's interpreter must be switched on before triton is imported, so it is set here, once, and only on
machines without a usable CUDA device: on the GPU machine the same tests run the compiled kernels.
"""

from __future__ import annotations

import os
import shutil


def _cuda_present() -> bool:
    # Cheap and without importing torch: a CUDA box has the driver's device nodes or nvidia-smi.
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if not _cuda_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    has_cuda = torch.cuda.is_available()
    cc = torch.cuda.get_device_capability() if has_cuda else (0, 0)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_sm90 = pytest.mark.skip(reason="needs compute capability >= 9.0")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "sm90" in item.keywords and cc < (9, 0):
            item.add_marker(skip_sm90)
