"""The public surface: a front door of at most twenty names, __all__ matching what each
public module exports, the names of an earlier release still working, and importing light."""

import email.parser
import importlib
import importlib.util
import shutil
import subprocess
import sys

import pytest

import aiocompile

PUBLIC_MODULES = ("aiocompile.errors", "aiocompile.records", "aiocompile.results", "aiocompile.lowlevel")


def test_all_is_sorted_and_complete():
    assert aiocompile.__all__ == sorted(aiocompile.__all__)
    assert set(aiocompile.__all__) == set(aiocompile._EXPORTS)
    assert len(aiocompile.__all__) <= 20, "the front door holds what a user needs on day one"
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


# What importing ``aiocompile.torch`` after torch must leave unimported: the scheduler's
# stack, and torch's compiler.
TORCH_FACE_HEAVY = ("aiocompile._core", "aiocompile._pool", "aiocompile.backends", "torch._inductor", "torch._dynamo")


def test_importing_the_torch_face_after_torch_imports_no_scheduler_and_no_compiler():
    pytest.importorskip("torch")
    # Then the two names a server looks up in its event loop: the scheduler's stack is
    # imported by whatever makes a scheduler, not by the lookup.
    code = ("import sys, torch; before = set(sys.modules); import aiocompile.torch; "
            f"heavy = lambda: sorted(m for m in set(sys.modules) - before if m.startswith({TORCH_FACE_HEAVY!r})); "
            "print(heavy()); aiocompile.torch.warm; aiocompile.torch.compile_in_background; "
            "print([m for m in heavy() if m != 'aiocompile.backends'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=importlib.import_module("conftest").subprocess_env()).stdout
    assert out.splitlines() == ["[]", "[]"]


def test_the_torch_face_resolves_each_public_name_at_first_use():
    import aiocompile.torch as aiotorch
    from aiocompile._torch import background, install, states, warming
    from aiocompile.backends.inductor import _worker

    assert dir(aiotorch) == sorted(aiotorch.__all__)
    homes = {"BackgroundCompiled": background, "BackgroundStatus": states, "PRELOAD": _worker,
             "ShapeStatus": states, "compile_in_background": background, "install": install,
             "installed": install, "is_installed": install, "uninstall": install, "warm": warming}
    assert set(homes) == set(aiotorch.__all__)
    for name, home in homes.items():
        assert getattr(aiotorch, name) is getattr(home, name)
    namespace = {}
    exec("from aiocompile.torch import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(aiotorch.__all__)
    with pytest.raises(AttributeError, match="no attribute 'not_a_thing'"):
        aiotorch.not_a_thing  # noqa: B018


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_each_public_module_exports_what_it_defines_or_re_exports(name):
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__)
    namespace = {}
    exec(f"from {name} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(module.__all__)
    for attr in module.__all__:
        obj = getattr(module, attr)
        if isinstance(obj, type) or callable(obj):
            assert obj.__doc__, f"{name}.{attr} has no docstring"


def test_the_names_an_earlier_release_had_at_the_top_still_work_off_the_front_door():
    from aiocompile import errors, lowlevel, records, results

    for name, module in aiocompile._MOVED.items():
        assert name not in aiocompile.__all__ and name not in dir(aiocompile)
        home = {"aiocompile.errors": errors, "aiocompile.records": records, "aiocompile.results": results,
                "aiocompile.lowlevel": lowlevel}[module]
        assert getattr(aiocompile, name) is getattr(home, name)
    for old, new in (("CompileTimeout", aiocompile.JobTimeout), ("WorkerCrashedError", aiocompile.WorkerCrashed)):
        for where in (aiocompile, errors):
            with pytest.warns(DeprecationWarning, match=f"{old} is now"):
                assert getattr(where, old) is new


def test_error_tree():
    from aiocompile.errors import AutotuneError, CompilerNotFound

    assert issubclass(aiocompile.JobError, aiocompile.AiocompileError)
    assert issubclass(aiocompile.CompileError, aiocompile.JobError)
    # A timeout or a crash is a job that gave no result, not a compile error.
    assert issubclass(aiocompile.JobTimeout, aiocompile.JobError)
    assert not issubclass(aiocompile.JobTimeout, aiocompile.CompileError)
    assert issubclass(aiocompile.JobTimeout, TimeoutError)
    assert issubclass(aiocompile.WorkerCrashed, aiocompile.JobError)
    assert not issubclass(aiocompile.WorkerCrashed, aiocompile.CompileError)
    assert issubclass(CompilerNotFound, aiocompile.CompileError)
    assert issubclass(CompilerNotFound, FileNotFoundError)
    assert issubclass(aiocompile.SchedulerClosed, aiocompile.AiocompileError)
    assert not issubclass(aiocompile.SchedulerClosed, aiocompile.JobError)
    assert issubclass(AutotuneError, aiocompile.CompileError)
    for cls in (aiocompile.AiocompileError, aiocompile.JobError, aiocompile.CompileError, aiocompile.JobTimeout,
                aiocompile.WorkerCrashed, AutotuneError, CompilerNotFound, aiocompile.SchedulerClosed):
        assert cls.__doc__ and "fault" in cls.__doc__, f"{cls.__name__} must say whose fault it is"


def test_errors_pickle_with_their_fields():
    import pickle

    crash = aiocompile.WorkerCrashed("boom", exitcode=-11, attempts=2, kernel_name="k", key="abc",
                                          target="cuda:90", output="tail")
    again = pickle.loads(pickle.dumps(crash))
    assert type(again) is aiocompile.WorkerCrashed
    assert (again.exitcode, again.attempts, again.kernel_name, again.key, again.target, again.output) == \
        (-11, 2, "k", "abc", "cuda:90", "tail")
    assert again.signal_name == "SIGSEGV"
    assert str(again) == str(crash)
    timeout = pickle.loads(pickle.dumps(aiocompile.JobTimeout("slow", timeout=1.5, kernel_name="k")))
    assert isinstance(timeout, TimeoutError) and timeout.timeout == 1.5
    tuning = aiocompile.errors.AutotuneError("none left", failures=(("BLOCK=64", "fault"),), kernel_name="k")
    again = pickle.loads(pickle.dumps(tuning))
    assert again.failures == (("BLOCK=64", "fault"),) and again.kernel_name == "k" and str(again) == str(tuning)
    failed = aiocompile.CompileError("g++ exited with status 1", kernel_name="lib", command="g++ -shared x.cpp")
    assert pickle.loads(pickle.dumps(failed)).command == "g++ -shared x.cpp"
    missing = pickle.loads(pickle.dumps(aiocompile.errors.CompilerNotFound("no nvcc found")))
    assert type(missing) is aiocompile.errors.CompilerNotFound and str(missing) == "no nvcc found"


def test_the_distribution_says_who_made_it_and_what_it_is_for(tmp_path):
    # The metadata a wheel carries, made from a copy of the sources (nothing written here),
    # by this environment's setuptools: one that builds wheels (pip builds in an isolated
    # environment of its own; a fresh venv of Python 3.11 has setuptools 65 and no wheel).
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None and importlib.util.find_spec("wheel") is None:
        pytest.skip("this environment's setuptools cannot build wheels (setuptools >= 70.1 or wheel needed)")
    root = importlib.import_module("conftest").ROOT
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, tmp_path / name)
    shutil.copytree(root / "aiocompile", tmp_path / "aiocompile", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "meta").mkdir()
    code = "import sys, setuptools.build_meta as b; print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    made = subprocess.run([sys.executable, "-c", code, str(tmp_path / "meta")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert made.returncode == 0, made.stderr
    metadata = email.parser.Parser().parsestr((tmp_path / "meta" / made.stdout.split()[-1] / "METADATA").read_text())
    assert metadata["Author"] == "aiocompile maintainers"
    assert metadata["License"] == "MIT" and "LICENSE" in metadata.get_all("License-File")
    classifiers = metadata.get_all("Classifier")
    assert "Framework :: AsyncIO" in classifiers and "Typing :: Typed" in classifiers
    assert "License :: OSI Approved :: MIT License" in classifiers
    assert "Programming Language :: Python :: 3.10" in classifiers  # as requires-python says
    assert metadata["Requires-Python"] == ">=3.10" and "triton" in metadata["Keywords"]
