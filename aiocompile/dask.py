"""Compiles on a Dask cluster, with the semantics of aiocompile's own pool.

::

    from dask.distributed import Client
    import aiocompile, aiocompile.dask

    client = Client("tcp://scheduler:8786")
    async with aiocompile.Scheduler(executor=aiocompile.dask.executor(client)) as sched:
        kernels = await sched.compile_many(specs)

``Scheduler(executor=client)`` does the same with the defaults. Needs ``distributed``
(``pip install 'aiocompile[dask]'``) here, and on every Dask worker the same versions of
aiocompile and Triton as here (the workers import them by name; a different Triton would
build a different kernel, refused here).

What the scheduler makes of a cluster (a worker that dies costs only the jobs it held, run
again one at a time; timeouts count from when a job is handed over, and a job past its
timeout has its worker process restarted by its nanny; answers travel as checksummed
bytes; kernels from ``__main__`` travel by their source) is in docs/api.md, "Other
executors". A compile cluster is best made of single-threaded worker processes with
nannies (``dask worker --nthreads 1 --nworkers N``): a compile holds its thread, job
settings are process-wide, and only a nanny can restart a worker.
"""

from aiocompile._foreign.dask import DaskExecutor, executor

__all__ = ["DaskExecutor", "executor"]
