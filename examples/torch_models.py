"""Small models to put under ``torch.compile``: an MLP, an attention block, a small conv
net, and two transformer blocks. ``make(name, device)`` returns the model in eval mode and
its inputs.

Used by ``tests/test_inductor.py``, ``benchmarks/bench_torch_compile.py`` and
``benchmarks/bench_background.py``; each gives Inductor a different mix of kernels
(pointwise fusions around matmuls; softmax and layer norm reductions; convolutions with
batch norm and pooling).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MLP(nn.Module):
    def __init__(self, width: int = 512, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x)) + x
        return self.norm(x).softmax(dim=-1)


class AttentionBlock(nn.Module):
    def __init__(self, dim: int = 256, heads: int = 8) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        # Written out rather than scaled_dot_product_attention, so that Inductor generates
        # the softmax itself.
        scores = (q @ k.transpose(-2, -1)) * (dim // self.heads) ** -0.5
        attended = scores.softmax(dim=-1) @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.mlp(self.norm2(x))


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1)).log_softmax(dim=-1)


def transformer(dim: int = 256, heads: int = 4, blocks: int = 2) -> nn.Sequential:
    """``blocks`` attention blocks in a row: the model a server puts in front of traffic."""
    return nn.Sequential(*(AttentionBlock(dim, heads) for _ in range(blocks)))


MODELS = ("mlp", "attention", "convnet", "transformer")


def make(name: str, device: str = "cuda", seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model called ``name`` (one of ``MODELS``) on ``device``, in eval mode, and
    example inputs for it."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model: nn.Module
    if name == "mlp":
        model, shape = MLP(), (64, 512)
    elif name == "attention":
        model, shape = AttentionBlock(), (4, 128, 256)
    elif name == "convnet":
        model, shape = ConvNet(), (8, 3, 32, 32)
    elif name == "transformer":
        model, shape = transformer(), (4, 128, 256)
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    inputs = (torch.randn(*shape, generator=generator).to(device),)
    return model.to(device).eval(), inputs
