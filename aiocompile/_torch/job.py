"""What a worker is sent for one background compile (``export.build_package`` runs it):
plain values, and the settings every package is built with."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from aiocompile._observe.repro import ReproRoot
from aiocompile._pool import serialize
from aiocompile._torch.parcel import Parcel

# Set on every package: the serving process gives the weights itself.
PACKAGE_CONFIGS = {"aot_inductor.package_constants_in_so": False}


@dataclass(frozen=True)
class ExportJob:
    """One background compile: everything the worker needs, in plain values."""

    name: str
    """The model's name, for messages and bundle names."""
    signature: str
    """The inputs, readable (``f32[4, 128, 256] cpu``)."""
    parcel: Parcel = field(repr=False)
    inputs: bytes = field(repr=False)
    """``torch.save((args, kwargs))``."""
    inductor_configs: dict[str, Any]
    device_index: int
    """Where the package runs: the inputs' CUDA device, or -1."""
    env: dict[str, str]
    """Inductor's environment variables (``ENV_PREFIXES``) as the parent has them: set
    here first, and those the parent lacks unset."""
    repro: ReproRoot | None
    form: str = "package"
    """What to build: ``"package"`` (AOTInductor's, with a C++ wrapper) or ``"python"``
    (Inductor's Python wrapper, :mod:`._graph`; a program it cannot run gets a package)."""

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Large inputs go beside the job's pickle, uncopied, as the model does (``Parcel``).
        values = [getattr(self, name) for name in _FIELDS]
        if protocol >= 5:
            values[_INPUTS] = serialize.out_of_band(self.inputs)
        return _export_job, tuple(values)


def _export_job(*values: Any) -> ExportJob:
    rebuilt = list(values)
    rebuilt[_INPUTS] = serialize.as_bytes(rebuilt[_INPUTS])
    return ExportJob(*rebuilt)


_FIELDS = tuple(item.name for item in fields(ExportJob))
_INPUTS = _FIELDS.index("inputs")


# Environment variables of Inductor's that a compile carries from the parent.
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCH_LOGS")
