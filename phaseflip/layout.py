"""Parallel layout: which slice of the model this process holds.

The layout is a runtime object held by the model runner and replaced whole by a layout change;
nothing reads ranks or groups from module globals. With one process every layer sees
`tp_size == 1` and the communicator's collectives are identities.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class Communicator:
    """Collectives of one tensor-parallel group. The single-process default does nothing."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over the group, in place (FP8 activation scales of a row)."""
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` stacked as `[size, *x.shape]` on group rank 0; None on the other
        ranks, which send theirs and receive nothing (the LM head: only one rank samples)."""
        return x.unsqueeze(0)


@dataclass(frozen=True)
class ProcessGroupCommunicator(Communicator):
    """Collectives over a torch.distributed process group (NCCL on GPUs, gloo on CPU).

    `staged`: the group is gloo but tensors live on a GPU (several ranks sharing one GPU for
    correctness runs) — collectives then go through host copies.
    """

    group: dist.ProcessGroup
    size: int
    staged: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.staged and x.is_cuda:
            host = x.cpu()
            dist.all_reduce(host, group=self.group)
            return x.copy_(host)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.staged and x.is_cuda:
            host = x.cpu()
            dist.all_reduce(host, op=dist.ReduceOp.MAX, group=self.group)
            return x.copy_(host)
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """`dist.gather` to group rank 0. On NCCL it is captured in the decode graphs with the
        LM head (NCCL's gather is a grouped send/recv on the group's communicator). Staged
        through the host it cannot be (a graph records no host copy or gloo call; the runner
        captures no graphs on a staged group), so there it runs eagerly."""
        src = x.contiguous().cpu() if self.staged and x.is_cuda else x.contiguous()
        root = dist.get_global_rank(self.group, 0)
        if dist.get_rank(self.group) != 0:
            dist.gather(src, None, dst=root, group=self.group)
            return None
        out = src.new_empty(self.size, *src.shape)
        dist.gather(src, list(out.unbind(0)), dst=root, group=self.group)
        return out.to(x.device)


@dataclass(frozen=True)
class Layout:
    """Tensor-parallel rank/size and the pipeline stage's layer range of one process."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_comm: Communicator = field(default_factory=Communicator)

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"invalid layout {self}")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """Contiguous [start, end) layers of this stage; earlier stages take the remainder."""
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return start, start + base + (1 if self.pp_rank < extra else 0)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """[start, end) of this TP rank's equal share of `total` units of `what`."""
        if total % self.tp_size:
            raise ValueError(f"{what}={total} is not divisible by tp_size={self.tp_size}")
        size = total // self.tp_size
        return self.tp_rank * size, (self.tp_rank + 1) * size
