"""The scheduler: the composition root that builds every other part and hands each a port.

- ``scheduler``: ``Scheduler``, the async front door, and the ports it hands out;
- ``requests``: a request's life, from its admission to its record;
- ``admission``: admitting a burst in bounded slices of an event loop's time;
- ``batch``: ``compile_many``; ``waiting``: ``wait``;
- ``jit``: what the scheduler does for Triton's JIT (``warmup``) and Inductor;
- ``costs``: how long compiles take, for starting the longest first;
- ``default``: the scheduler behind the module-level functions.
"""
