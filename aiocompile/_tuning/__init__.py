"""``autotune()``: tuning ``@triton.autotune`` kernels without stalling the caller.

- ``_plan``: what Triton's autotuner would do for a launch (its key, its pruning, each
  configuration's specialisation and launch), worked out with Triton's own code;
- ``_inputs``: a launch's tensors, carried to a benchmark process (shapes, strides,
  aliasing, alignment and values);
- ``_task``: what a benchmark process is asked, and the messages it speaks;
- ``_benchproc``: a benchmark process's life (a state machine) and starting one;
- ``_benchpool``: one process per device, and the queue of configurations they time;
- ``_bench_main``: what runs inside a benchmark process; ``_gpu_timer``: its real timer,
  Triton's own benchmarking;
- ``_decisions``: decisions kept in memory and in ``cache_dir``;
- ``_tuner``: ``autotune()`` itself: plan, decide (compile, time, choose), prime.
"""
