"""Jobs for the burst benchmarks: importable, so that every pool sends them by reference."""


def identity(value):
    return value


def big_bytes(size):
    return b"x" * size
