"""CUDA C++ compiled at run time (NVRTC) and launched through the driver API, by ctypes.

For kernels that Triton cannot express well (an 8-bit operand the MMA wants transposed): no
nvcc, no build step — NVRTC ships with the CUDA wheels torch depends on, and the driver loads
the cubin. Probe-grade: one module per source, launches on torch's current stream (so CUDA
graphs capture them).
"""

from __future__ import annotations

import ctypes
import glob
import os
import site
import sys
from pathlib import Path
from typing import Any

import torch


def _find_nvrtc() -> str:
    env = os.environ.get("PHASEFLIP_NVRTC")
    if env:
        return env
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path,
             "/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"]
    pats = ["nvidia/cuda_nvrtc/lib/libnvrtc.so*", "nvidia/cu13/lib/libnvrtc.so*",
            "nvidia/*/lib/libnvrtc.so*", "libnvrtc.so*", "torch/lib/libnvrtc*.so*"]
    for root in roots:
        for pat in pats:
            hits = sorted(p for p in glob.glob(os.path.join(root, pat))
                          if "builtins" not in p and "alt" not in p)
            if hits:
                return hits[0]
    raise RuntimeError("libnvrtc not found (set PHASEFLIP_NVRTC to its path)")


def compile_cubin(src: str, name: str, arch: str = "sm_90a",
                  options: tuple[str, ...] = ()) -> bytes:
    """NVRTC: CUDA C++ source -> cubin for `arch` (raises with the compile log)."""
    lib = ctypes.CDLL(_find_nvrtc())
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0,
                                None, None)
    if rc:
        raise RuntimeError(f"nvrtcCreateProgram failed ({rc})")
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *options]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        raise RuntimeError(f"NVRTC failed for {name}:\n{log.value.decode(errors='replace')}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


class CudaKernel:
    """One `extern "C"` kernel of a cubin, launched on torch's current stream."""

    def __init__(self, cubin: bytes, name: str) -> None:
        torch.empty(1, device="cuda")  # the runtime's primary context, current on this thread
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._module = ctypes.c_void_p()
        self._check(self._cuda.cuModuleLoadData(ctypes.byref(self._module), cubin),
                    "cuModuleLoadData")
        self._fn = ctypes.c_void_p()
        self._check(self._cuda.cuModuleGetFunction(ctypes.byref(self._fn), self._module,
                                                   name.encode()), "cuModuleGetFunction")

    def allow_shared(self, nbytes: int) -> None:
        """Lets launches ask for more than 48 KB of dynamic shared memory."""
        self._check(self._cuda.cuFuncSetAttribute(self._fn, 8, nbytes),  # MAX_DYNAMIC_SHARED
                    "cuFuncSetAttribute")

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what} failed (CUresult {rc})")

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: list[Any], shared: int = 0) -> None:
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, ctypes._SimpleCData):
                holders.append(a)
            else:
                raise TypeError(f"pass ints/floats as ctypes values, got {type(a)}")
        params = (ctypes.c_void_p * len(holders))(
            *[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self._cuda.cuLaunchKernel(self._fn, *grid, *block, shared, stream, params,
                                              None), "cuLaunchKernel")


def source(name: str) -> str:
    return (Path(__file__).parent / name).read_text()
