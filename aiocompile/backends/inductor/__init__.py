"""The Inductor backend: kernels PyTorch Inductor generated, compiled in the pool and handed
back as the kernel objects Inductor expects (``_backend``), and what a worker runs for them
(``_worker``). Needs torch, imported only when used."""

from aiocompile.backends.inductor._backend import (
    InductorArtifact,
    InductorSource,
    build_request,
    parse_source,
    prepare,
)

__all__ = ["InductorArtifact", "InductorSource", "build_request", "parse_source", "prepare"]
