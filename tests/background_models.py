"""Models the background-compile tests send to workers (importable, so they pickle by
reference)."""

import threading

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x))) + x


class DataDependent(nn.Module):
    """Branches on a value it computes: ``torch.export`` cannot trace that."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * self.scale
        return -x


class HoldsALock(MLP):
    """A model that will not pickle."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def make_mlp(seed: int = 0) -> tuple[MLP, torch.Tensor]:
    torch.manual_seed(seed)
    return MLP().eval(), torch.randn(4, 16)


def vec_isa_known() -> tuple[int, str]:
    """Run in a worker: how many answers Inductor's CPU vector-ISA check holds in this
    process (1 once it has run), and the instruction set it picks."""
    from torch._inductor import cpu_vec_isa

    known = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
    return known, str(cpu_vec_isa.pick_vec_isa()) if known else ""
