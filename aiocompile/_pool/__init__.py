"""aiocompile's own worker pool: one job per worker process, supervised.

- ``pool``: ``WorkerPool``, the ``Executor`` face, which owns its supervisor;
- ``supervisor``: the thread that starts, feeds, watches and replaces workers;
- ``handle``: the parent's handle on one worker, a state machine (``state``);
- ``job``: a job, its outcome and the pool's counters;
- ``protocol``: every frame between the parent, its workers and the fork server;
- ``loop_reads``: small answers read by an asyncio event loop itself;
- ``launch``: the three start methods; ``zygote``: the fork server;
- ``child``: the worker's loop, inside the worker process;
- ``procs``: process groups, dying with the parent, the environment a job carries;
- ``serialize``: pickling a job for a worker that has not imported ``__main__``.
"""
