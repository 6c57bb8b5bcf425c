"""The driver's numbers the fake uses: ``CUresult`` codes and ``CUprocessState`` values.

The values are the real driver's (``cuda.h``); the fake libcuda's C table of names and
texts (``fakecuda.c``, ``cuGetErrorName``/``cuGetErrorString``) carries the same codes,
and tests/test_fakecuda.py checks the two agree.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["DRIVER_VERSION", "DRIVER_VERSION_NO_API", "PROCESS_STATES", "CUresult"]

DRIVER_VERSION = 12080  # what cuDriverGetVersion reports: r570, the first with the API
DRIVER_VERSION_NO_API = 12040  # the r550-like build without the cuCheckpoint* symbols


class CUresult(IntEnum):
    """The ``CUresult`` codes the fake driver returns."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_OPERATING_SYSTEM = 304
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_TIMEOUT = 909
    CUDA_ERROR_UNKNOWN = 999


# CUprocessState, by the ledger's state names (the enum's order).
PROCESS_STATES: dict[str, int] = {"running": 0, "locked": 1, "checkpointed": 2, "failed": 3}
