"""What aiocompile tells about itself:

- ``metrics``: the counters and summaries behind ``statistics()``;
- ``events``: where records and worker events go (logging, a JSON-lines file, listeners);
- ``report``: reading an event log back (``aiocompile report``);
- ``repro``: a directory per failed compile, to look at it again;
- ``progress``: a progress bar over many compiles.
"""
