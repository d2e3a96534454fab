"""The errors of Inductor's native builds, as both families see them.

A C++ kernel that does not compile raises ``CppCompileError`` in Inductor's own build, and
code around Inductor catches that class by name. Through aiocompile the same failure is a
``CompileError`` as well, so that either ``except`` clause catches it: each class below is
both, with the compiler's command (``cmd``) and output (``output``) as Inductor's has them.

Importing this module imports torch: only a worker that has just seen a build fail, and a
parent that unpickles its error, need it.
"""

from __future__ import annotations

from torch._inductor import exc as _inductor_exc

from aiocompile.errors import CompileError

__all__ = ["InductorCUDACompileError", "InductorCppCompileError", "build_error"]


class InductorCppCompileError(CompileError, _inductor_exc.CppCompileError):
    """A C++ kernel Inductor generated did not compile. Whose fault: the kernel's (or the
    compiler's). ``cmd`` is the command that failed, ``output`` what the compiler said."""

    def __init__(
        self,
        message: str,
        *,
        cmd: list[str] | None = None,
        kernel_name: str | None = None,
        key: str | None = None,
        target: str | None = None,
        output: str = "",
    ) -> None:
        # Not through CompileError.__init__: its super().__init__(message) would reach
        # CppCompileError.__init__(cmd, output) in this class's MRO.
        Exception.__init__(self, message)
        self.message = message
        self.kernel_name = kernel_name
        self.key = key
        self.target = target
        self.output = output
        self.cmd = list(cmd or ())


class InductorCUDACompileError(InductorCppCompileError, _inductor_exc.CUDACompileError):
    """A CUDA kernel Inductor generated (CUTLASS) did not compile."""


def build_error(exc: BaseException, *, name: str, key: str | None, target: str | None) -> CompileError:
    """The error a failed build is reported with: Inductor's compile errors as the classes
    above, anything else (a compiler that is not there, a lock that timed out) as a plain
    ``CompileError`` naming what it was."""
    if isinstance(exc, _inductor_exc.CppCompileError):
        cls = InductorCUDACompileError if isinstance(exc, _inductor_exc.CUDACompileError) else InductorCppCompileError
        output = getattr(exc, "output", "")
        return cls(str(exc), cmd=getattr(exc, "cmd", None), kernel_name=name, key=key, target=target,
                   output=output if isinstance(output, str) else "")
    text = str(exc).strip()
    message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return CompileError(message, kernel_name=name, key=key, target=target)
