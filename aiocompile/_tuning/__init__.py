"""``autotune()``: tuning ``@triton.autotune`` kernels without stalling the caller.

- ``plan``: what Triton's autotuner would do for a launch (its key, its pruning, each
  configuration's specialisation and launch), worked out with Triton's own code;
- ``inputs``: a launch's tensors, carried to a benchmark process (shapes, strides,
  aliasing, alignment and values);
- ``task``: what a benchmark process is asked, and the messages it speaks;
- ``benchproc``: a benchmark process's life (a state machine) and starting one;
- ``benchpool``: one process per device, and the queue of configurations they time;
  ``timing``: where configurations are timed (the devices, the timer);
- ``bench_main``: what runs inside a benchmark process; ``gpu_timer``: its real timer,
  Triton's own benchmarking;
- ``decisions``: decisions kept in memory and in ``cache_dir``;
- ``tuner``: ``autotune()`` itself: plan, decide (compile, time, choose), prime.
"""
