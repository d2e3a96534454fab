"""What experts reach for, kept off the front door:

- :class:`WorkerPool`: aiocompile's supervised pool on its own, as a
  ``concurrent.futures.Executor`` (one job per worker process, crashes retried, timeouts
  and kills of one job only);
- :func:`default_scheduler`: the scheduler behind the module-level functions;
- :func:`inductor_triton`: a kernel PyTorch Inductor generated, compiled in the pool and
  handed back as the kernel object Inductor expects.
"""

from aiocompile._core.default import default_scheduler, inductor_triton
from aiocompile._pool.pool import WorkerPool

__all__ = [
    "WorkerPool",
    "default_scheduler",
    "inductor_triton",
]
