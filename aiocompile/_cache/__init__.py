"""Where results are kept, nearest first:

- ``memory``: results by key in this process, with single-flight entries;
- ``disk``: ``cache_dir``, results that outlive the process (``sealed`` signs its entries);
- ``shared``: ``cache_url``, a Redis server a fleet shares, behind a ``breaker``.
"""
