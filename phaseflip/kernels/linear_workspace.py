"""The split-K workspace of the skinny GEMM (`kernels/linear.py`) and the tile GEMM
(`kernels/tile_gemm.py`): fp32 partial tiles and int32 arrival counters, one per device, held
while any runner's CUDA graphs may point at them; and `split_arrive`, the arrival both
kernels count in them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SplitKWorkspace:
    """fp32 partial tiles and int32 arrival counters for split launches on one device.

    Launches that share a workspace must be ordered (one stream, or a CUDA graph of one
    stream): the counters are re-armed by each launch's last arrivals, and the partials are
    overwritten. Grows only outside graph capture (`warmup` sizes it beforehand). Outgrown
    buffers are kept, not freed: a graph captured earlier still points at them. Keep the
    workspace alive as long as any graph captured with it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.partials = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self._outgrown: list[torch.Tensor] = []

    def reserve(self, partial_elems: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partials.numel() < partial_elems or self.counters.numel() < num_tiles:
            if _capturing(self.device):
                raise RuntimeError(
                    f"split-K workspace too small during CUDA-graph capture (need "
                    f"{partial_elems} floats, {num_tiles} counters): call the kernel's warmup "
                    f"(phaseflip.kernels.linear / tile_gemm) with this shape before capturing")
            elems = max(self.partials.numel(), triton.next_power_of_2(partial_elems))
            tiles = max(self.counters.numel(), triton.next_power_of_2(num_tiles))
            self._outgrown += [self.partials, self.counters]
            self.partials = torch.empty(elems, dtype=torch.float32, device=self.device)
            # Fresh counters start at 0; the old ones are all 0 at rest (self-re-arming).
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=self.device)
        return self.partials, self.counters


_WORKSPACES: dict[torch.device, SplitKWorkspace] = {}
# runners (model runners of this process) that may have captured graphs with a device's
# workspace: it is freed, outgrown buffers included, when the last of them lets go
_HOLDERS: dict[torch.device, int] = {}


def _one_name(device: torch.device) -> torch.device:
    """`cuda` and `cuda:<current>` are one device (tensors report the index; callers may not):
    one key, so a warm-up and the launches it prepares share a workspace."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def workspace_for(device: torch.device) -> SplitKWorkspace:
    """The default workspace of `device` (one per device; see SplitKWorkspace for ordering)."""
    device = _one_name(device)
    if device not in _WORKSPACES:
        _WORKSPACES[device] = SplitKWorkspace(device)
    return _WORKSPACES[device]


def hold_workspace(device: torch.device) -> None:
    """A runner on `device` starts using its workspace (its graphs may capture it)."""
    device = _one_name(device)
    _HOLDERS[device] = _HOLDERS.get(device, 0) + 1


def release_workspace(device: torch.device) -> None:
    """A runner on `device` is done (its graphs released): the last one out frees the
    workspace and every outgrown buffer; the next launch makes a fresh one."""
    device = _one_name(device)
    left = _HOLDERS.get(device, 0) - 1
    if left > 0:
        _HOLDERS[device] = left
        return
    _HOLDERS.pop(device, None)
    _WORKSPACES.pop(device, None)


@triton.jit
def split_arrive(acc, tile, counter, pid_k, num_splits, tile_elems: tl.constexpr):
    """Stores split pid_k's partial tile and counts its arrival: whether it came last (and so
    sums the tile's partials). Every thread's partial is written before one thread publishes
    the arrival (release); the acquire side makes the others' partials visible to the last."""
    tl.store(tile + pid_k * tile_elems, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    last = arrived == num_splits - 1
    if last:
        tl.debug_barrier()
    return last
