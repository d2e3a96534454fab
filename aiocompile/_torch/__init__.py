"""The torch integration behind ``aiocompile.torch`` (torch is imported only when used):

- ``install``: ``install()``/``uninstall()``, what replaces Inductor's ``AsyncCompile``;
- ``async_triton``: how ``AsyncCompile.triton`` is answered while installed;
- ``autotune``: max-autotune's template choices timed in aiocompile's benchmark processes;
- ``background``: ``compile_in_background``, with ``states``, ``parcel`` (the model sent to
  a worker), ``export``, ``graph``, ``ahead``, ``cxx``, ``isa`` (what the worker does);
- ``bundles``, ``graph_repro``: repro bundles of torch compiles.

The requests for Inductor's generated kernels are a compiler backend:
``aiocompile.backends.inductor``.
"""
