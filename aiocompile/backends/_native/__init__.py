"""What the backends that run a compiler program (C++: ``backends.cpp``; CUDA and ROCm:
``backends.cuda``) share:

- ``_compiler``: finding the compiler (``compiler=``, ``PATH``, ``CUDA_HOME``...), and
  its identity and version, asked once per process, off the event loop;
- ``_headers``: the headers a source reads from its include directories, whose contents
  go into its key, and paths in flags made absolute;
- ``_inputs``: the other files a command line reads (response files, expanded; linker
  scripts, objects, libraries found by ``-l``), whose contents go into its key;
- ``_run``: running the compiler in a worker (a scratch directory, its output, its time)
  and its failure as a ``CompileError`` with the diagnostics and the command line; the
  dependency pass (``-MM``) a key may need, run in a worker too;
- ``_artifact``: the versioned, checksummed byte form of the artifacts;
- ``_load``: loading a shared library from its bytes, through ctypes;
- ``_backend``: what the backends do in the parent: arguments checked at the boundary,
  then the compiler found, the headers scanned and the key made in the key thread.

None of it but ``_backend`` (anyio, for a batch's dependency passes side by side) imports
anything beyond the standard library.
"""
