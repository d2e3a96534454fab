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


def first_compile_paid() -> dict[str, int]:
    """Run in a worker: what a first compile for the CPU sets up once per process, as far
    as Inductor's own caches tell it: the vector-ISA check's answer, and the pattern passes
    (each 1 once made)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.fx_passes import joint_graph

    return {"vec_isa": cpu_vec_isa.valid_vec_isa_list.cache_info().currsize,
            "patterns": joint_graph.lazy_init.cache_info().currsize}


def compile_modules_loaded() -> list[str]:
    """Run in a worker: which of the modules a background compile imports are loaded."""
    import sys

    from aiocompile._torch import export

    return [name for name in export._MODULES if name in sys.modules]


def modules_loaded(names: list[str]) -> list[str]:
    """Run in a worker: which of ``names`` it has imported."""
    import sys

    return [name for name in names if name in sys.modules]


class Keyed(nn.Module):
    """A parameter, a buffer, a tensor constant made during tracing, a plain int argument
    and keyword inputs, with a structured output: every kind of input the Python form
    binds."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("shift", torch.linspace(-1, 1, width))
        self.offset = torch.tensor([0.5])  # neither parameter nor buffer: a constant to export

    def forward(self, x: torch.Tensor, times: int, *, gate: torch.Tensor, bias: torch.Tensor) -> dict:
        y = self.proj(x) * times + self.shift + self.offset
        return {"y": y * torch.sigmoid(gate), "parts": (y.sum(-1), bias * 2)}


class Counts(nn.Module):
    """Adds to a buffer at every call: a program that mutates its state."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x * 2


def keyed_inputs(seed: int = 0) -> tuple[tuple, dict]:
    generator = torch.Generator().manual_seed(seed)
    return ((torch.randn(4, 16, generator=generator), 3),
            {"gate": torch.randn(4, 16, generator=generator), "bias": torch.randn(2, generator=generator)})


class NotesThreads(MLP):
    """An MLP whose eager calls note torch's intra-op thread count they ran with (a Python
    side effect the compiled version leaves out)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return super().forward(x)
