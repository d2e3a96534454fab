"""What every other part of aiocompile stands on, and which stands on nothing of aiocompile's
but the error tree:

- ``checks``: the one set of rules that settings and arguments are checked by, once, where
  they come in; ``config``: ``SchedulerConfig``, the settings every room reads, built from
  arguments or (``from_env``) the environment, checked by those rules;
- ``target``: compile targets ("cuda:90", "hip:gfx942", a ``GPUTarget``) without Triton;
- ``threads``: the lanes of threads the parent process does its own blocking work in
  (keys, loads);
- ``bridge``: awaiting a ``concurrent.futures.Future`` from asyncio, uvloop or trio;
- ``version``: the package's version.
"""
