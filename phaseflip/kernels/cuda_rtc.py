"""CUDA C++ compiled at run time (NVRTC) and launched through the driver API, by ctypes.

For kernels Triton cannot express well (an 8-bit operand the MMA wants transposed), without a
build step: NVRTC ships with the CUDA wheels torch depends on (`nvidia/cu13/lib`), and the
driver loads the cubin. Compiled cubins are cached on disk by source, options, architecture and
NVRTC version. Launches go on torch's current stream, so CUDA graphs capture them.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import site
import sys
from pathlib import Path
from typing import Any

import torch

NVRTC_ENV = "PHASEFLIP_NVRTC"  # a libnvrtc path, when the search below misses it
CACHE_ENV = "PHASEFLIP_CUDA_CACHE"  # cubin cache folder (default ~/.cache/phaseflip/cubin)
_SHARED_ATTR = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_NUM_REGS_ATTR = 4  # CU_FUNC_ATTRIBUTE_NUM_REGS


def find_nvrtc() -> str:
    """Path of libnvrtc: $PHASEFLIP_NVRTC, else the pip CUDA wheels, else a system CUDA."""
    env = os.environ.get(NVRTC_ENV)
    if env:
        return env
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path,
             "/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu"]
    pats = ["nvidia/cu13/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*",
            "nvidia/*/lib/libnvrtc.so*", "libnvrtc.so*"]
    for root in roots:
        for pat in pats:
            hits = sorted(p for p in glob.glob(os.path.join(root, pat))
                          if "builtins" not in p and ".alt." not in p)
            if hits:
                return hits[0]
    raise RuntimeError(f"libnvrtc not found (set {NVRTC_ENV} to its path)")


def _nvrtc_version(lib: ctypes.CDLL) -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def compile_cubin(src: str, name: str, arch: str = "sm_90a",
                  options: tuple[str, ...] = ()) -> bytes:
    """NVRTC: CUDA C++ source -> cubin for `arch`, from the disk cache when compiled before
    (raises with NVRTC's log on a compile error)."""
    lib = ctypes.CDLL(find_nvrtc())
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *options]
    key = hashlib.sha256("\0".join([src, arch, _nvrtc_version(lib), *opts]).encode())
    cache = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "phaseflip" / "cubin"))
    path = cache / f"{name}-{key.hexdigest()[:20]}.cubin"
    if path.exists():
        return path.read_bytes()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0,
                              None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        if rc:
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed for {name}:\n{log.value.decode(errors='replace')}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin.raw)
    tmp.replace(path)  # atomic: concurrent ranks may compile the same source
    return cubin.raw


class CudaKernel:
    """One `extern "C"` kernel of a cubin, launched on torch's current stream."""

    def __init__(self, cubin: bytes, name: str, device: torch.device) -> None:
        torch.empty(1, device=device)  # torch's primary context, current on this thread
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._module = ctypes.c_void_p()
        self._check(self._cuda.cuModuleLoadData(ctypes.byref(self._module), cubin),
                    "cuModuleLoadData")
        self._fn = ctypes.c_void_p()
        self._check(self._cuda.cuModuleGetFunction(ctypes.byref(self._fn), self._module,
                                                   name.encode()), "cuModuleGetFunction")

    def allow_shared(self, nbytes: int) -> None:
        """Lets launches ask for more than 48 KB of dynamic shared memory."""
        self._check(self._cuda.cuFuncSetAttribute(self._fn, _SHARED_ATTR, nbytes),
                    "cuFuncSetAttribute")

    @property
    def registers(self) -> int:
        """Registers a thread of the kernel holds (what bounds its CTAs an SM)."""
        val = ctypes.c_int()
        self._check(self._cuda.cuFuncGetAttribute(ctypes.byref(val), _NUM_REGS_ATTR, self._fn),
                    "cuFuncGetAttribute")
        return val.value

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what} failed (CUresult {rc})")

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: list[Any], shared: int = 0) -> None:
        """`args`: tensors (passed as device pointers), None (a null pointer) or ctypes
        scalars, in the kernel's parameter order."""
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif a is None:
                holders.append(ctypes.c_void_p(0))
            elif isinstance(a, ctypes._SimpleCData):
                holders.append(a)
            else:
                raise TypeError(f"pass scalars as ctypes values, got {type(a)}")
        params = (ctypes.c_void_p * len(holders))(
            *[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self._cuda.cuLaunchKernel(self._fn, *grid, *block, shared, stream, params,
                                              None), "cuLaunchKernel")
