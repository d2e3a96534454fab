"""The public surface: __all__ matches what the package exports, and importing is light."""

import subprocess
import sys

import pytest

import aiocompile


def test_all_is_sorted_and_complete():
    assert aiocompile.__all__ == sorted(aiocompile.__all__)
    assert set(aiocompile.__all__) == set(aiocompile._EXPORTS) | {"__version__"}
    assert dir(aiocompile) == aiocompile.__all__
    for name in aiocompile.__all__:
        assert getattr(aiocompile, name) is not None
    namespace = {}
    exec("from aiocompile import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(aiocompile.__all__)
    # Each name comes from the module that defines it (explicit re-exports only).
    for name, module in aiocompile._EXPORTS.items():
        assert getattr(__import__(module, fromlist=[name]), name) is getattr(aiocompile, name)


def test_unknown_names_raise_attribute_error():
    with pytest.raises(AttributeError):
        aiocompile.not_a_thing  # noqa: B018


def test_every_export_is_documented():
    for name in aiocompile.__all__:
        obj = getattr(aiocompile, name)
        if callable(obj):
            assert obj.__doc__, f"aiocompile.{name} has no docstring"


def test_import_is_light():
    code = ("import sys, aiocompile; print(' '.join(str(m in sys.modules) for m in "
            "('triton', 'torch', 'anyio', 'aiocompile._core.scheduler', 'redis', 'distributed', 'dask')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"] * 7


def test_error_tree():
    assert issubclass(aiocompile.CompileError, aiocompile.AiocompileError)
    assert issubclass(aiocompile.CompileTimeout, aiocompile.CompileError)
    assert issubclass(aiocompile.CompileTimeout, TimeoutError)
    assert issubclass(aiocompile.WorkerCrashedError, aiocompile.CompileError)
    assert issubclass(aiocompile.CompilerNotFound, aiocompile.CompileError)
    assert issubclass(aiocompile.CompilerNotFound, FileNotFoundError)
    assert issubclass(aiocompile.SchedulerClosed, aiocompile.AiocompileError)
    assert issubclass(aiocompile.AutotuneError, aiocompile.CompileError)
    for cls in (aiocompile.AiocompileError, aiocompile.CompileError, aiocompile.CompileTimeout,
                aiocompile.WorkerCrashedError, aiocompile.AutotuneError, aiocompile.CompilerNotFound,
                aiocompile.SchedulerClosed):
        assert cls.__doc__ and "fault" in cls.__doc__, f"{cls.__name__} must say whose fault it is"


def test_errors_pickle_with_their_fields():
    import pickle

    crash = aiocompile.WorkerCrashedError("boom", exitcode=-11, attempts=2, kernel_name="k", key="abc",
                                          target="cuda:90", output="tail")
    again = pickle.loads(pickle.dumps(crash))
    assert type(again) is aiocompile.WorkerCrashedError
    assert (again.exitcode, again.attempts, again.kernel_name, again.key, again.target, again.output) == \
        (-11, 2, "k", "abc", "cuda:90", "tail")
    assert again.signal_name == "SIGSEGV"
    assert str(again) == str(crash)
    timeout = pickle.loads(pickle.dumps(aiocompile.CompileTimeout("slow", timeout=1.5, kernel_name="k")))
    assert isinstance(timeout, TimeoutError) and timeout.timeout == 1.5
    tuning = aiocompile.AutotuneError("none left", failures=(("BLOCK=64", "fault"),), kernel_name="k")
    again = pickle.loads(pickle.dumps(tuning))
    assert again.failures == (("BLOCK=64", "fault"),) and again.kernel_name == "k" and str(again) == str(tuning)
    failed = aiocompile.CompileError("g++ exited with status 1", kernel_name="lib", command="g++ -shared x.cpp")
    assert pickle.loads(pickle.dumps(failed)).command == "g++ -shared x.cpp"
    missing = pickle.loads(pickle.dumps(aiocompile.CompilerNotFound("no nvcc found")))
    assert type(missing) is aiocompile.CompilerNotFound and str(missing) == "no nvcc found"
