"""Foreign executors behind the scheduler: a stdlib ``ProcessPoolExecutor``, loky, a Dask
cluster.

- ``pool``: ``ForeignPool``, any ``concurrent.futures.Executor`` made crash-safe;
- ``sent``: a job handed to the executor, its life as a state machine;
- ``executors``: what it knows about executors (rebuilding one, adapting a Dask client);
- ``remote``: what runs in the foreign workers;
- ``dask``: the executor over a Dask cluster (``aiocompile.dask`` is its public face).
"""
