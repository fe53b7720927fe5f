"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernel chain.

A batch-1 decode step is ~330 short kernels; most of its time is the skinny GEMMs streaming
weights, and each GEMM's first bytes arrive only after the kernel before it has finished and
the GEMM has launched. With PDL the GEMM is launched while that kernel still runs: its
programs prefetch their first weight tile into L2, then wait (`griddepcontrol.wait`) until
the previous kernel has finished and its writes are visible, and only then read activations
or write anything. Weights are never written by a kernel, so reading them early is safe. The
kernels that feed GEMMs (norms, SiLU·mul, the attention merge, per-token quantization) signal
their dependents at their start (`griddepcontrol.launch_dependents`): a scheduling hint that
lets the GEMM's programs take the SMs those kernels leave idle; it orders no memory.

The kernels between the GEMMs (norms, SiLU·mul, per-token quantization, rotary + KV store,
Triton decode attention) launch with PDL too (`chain_launch_options`): each waits at its very
start, before any load or store, so it may only take the launch and the SM hand-over off the
chain, never reorder memory. The tile GEMM (129-1 024 rows) can too, prefetching its first
weight tile before its wait as the skinny kernel does (`tile_gemm.PDL_LAUNCH`, off until
measured). The GEMMs signal their dependents once their main loop is done (every program
of the grid is then resident, so no waiting dependent takes an SM a later wave of theirs
needs), the decode attention at its end (its split merge runs inside it), the small kernels
at their start. A kernel launched with PDL must wait in every program,
even one with nothing to do: the next kernel waits only for this one, so this one finishing
must imply the one before it finished. `PHASEFLIP_PDL_GEMMS_ONLY=1` launches all of these
plainly again and drops the GEMMs' and the attention's signals: the skinny GEMMs alone with
PDL, the scope before 2026-12-06 (for A/B runs).

`PHASEFLIP_NO_PDL=1` turns it off (A/B runs, a driver that mishandles it); off on GPUs before
sm_90, on ROCm and in the Triton interpreter, whose kernels compile without the instructions.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

NO_PDL_ENV = "PHASEFLIP_NO_PDL"
GEMMS_ONLY_ENV = "PHASEFLIP_PDL_GEMMS_ONLY"
_CAPABLE: dict[int, bool] = {}


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA sm_90+, compiled (not interpreted),
    and not switched off by `PHASEFLIP_NO_PDL`."""
    if (device.type != "cuda" or torch.version.hip is not None  # (ROCm: no griddepcontrol)
            or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if os.environ.get(NO_PDL_ENV, "") not in ("", "0"):
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _CAPABLE[idx]


def launch_options(device: torch.device) -> dict[str, bool]:
    """The launch keyword a dependent kernel (one that waits with `prefetch_then_wait`) gets."""
    return {"launch_pdl": True} if pdl_enabled(device) else {}


def chain_launch_options(device: torch.device) -> dict[str, bool]:
    """The launch keyword of a kernel between GEMMs (one that starts with `wait_previous`)."""
    if os.environ.get(GEMMS_ONLY_ENV, "") not in ("", "0"):
        return {}
    return launch_options(device)


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Wait for the previous kernel to finish and its writes to be visible (a no-op unless
    this kernel was launched with PDL). Call it before any load or store."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel, if launched with PDL, start once every program got here."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_then_wait(ptrs, PDL: tl.constexpr):
    """Prefetch the lines at `ptrs` (read-only data: weights) into L2, then wait for the
    previous kernel to finish and its writes to be visible. Nothing before this may read
    what an earlier kernel writes, nor write anything."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()
