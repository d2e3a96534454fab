"""The public surface: __all__ matches what the package exports, and importing is light."""

import subprocess
import sys

import aiocompile


def test_all_is_sorted_and_complete():
    assert aiocompile.__all__ == sorted(aiocompile.__all__)
    public = {name for name in dir(aiocompile) if not name.startswith("_")}
    # Submodules are reachable as attributes but are not part of the API.
    public -= {"backends", "cli"}
    assert public == set(aiocompile.__all__) - {"__version__"}


def test_every_export_is_documented():
    for name in aiocompile.__all__:
        obj = getattr(aiocompile, name)
        if callable(obj):
            assert obj.__doc__, f"aiocompile.{name} has no docstring"


def test_import_does_not_load_triton_or_torch():
    code = "import sys, aiocompile; print('triton' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_error_tree():
    assert issubclass(aiocompile.CompileError, aiocompile.AiocompileError)
    assert issubclass(aiocompile.CompileTimeout, aiocompile.CompileError)
    assert issubclass(aiocompile.CompileTimeout, TimeoutError)
    assert issubclass(aiocompile.WorkerCrashedError, aiocompile.CompileError)
    assert issubclass(aiocompile.SchedulerClosed, aiocompile.AiocompileError)
    for cls in (aiocompile.AiocompileError, aiocompile.CompileError, aiocompile.CompileTimeout,
                aiocompile.WorkerCrashedError, aiocompile.SchedulerClosed):
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
