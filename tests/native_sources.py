"""C++ and CUDA sources the native tests compile, and what they need of the machine."""

import os

import anyio
import pytest

from aiocompile.backends._native import _compiler
from aiocompile.errors import CompilerNotFound

ADD = 'extern "C" int add(int a, int b) { return a + b; }\n'

# A function that uses the standard library, as a real one would: sorted, deduplicated
# values, their sum.
UNIQUE_SUM = """\
#include <algorithm>
#include <numeric>
#include <vector>

extern "C" long unique_sum(const int* values, int n) {
    std::vector<int> v(values, values + n);
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return std::accumulate(v.begin(), v.end(), 0L);
}
"""

VECTOR_ADD = """\
extern "C" __global__ void vector_add(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}
"""

# The same kernel in HIP, for AMD GPUs: HIP's runtime header declares the thread indices.
HIP_VECTOR_ADD = "#include <hip/hip_runtime.h>\n" + VECTOR_ADD

# Compiles for as long as one lets it: g++ evaluates 4e10 steps of a constant expression
# (cc1plus at full speed, in a few MB); nvcc builds 2000 distinct device functions and
# ptxas then takes tens of seconds over them.
SLOW_CPP = """\
constexpr long spin() {
    long s = 0;
    for (long i = 0; i < 200000; ++i)
        for (long j = 0; j < 200000; ++j)
            s += i ^ j;
    return s;
}
extern "C" long value() { constexpr long v = spin(); return v; }
"""
SLOW_CPP_FLAGS = ("-fconstexpr-ops-limit=1000000000000",)

SLOW_CUDA = """\
#include <utility>
template <int I> __device__ __noinline__ float g(float x) { return x * (I + 1) + I; }
template <int... Is> __device__ float sum(float x, std::integer_sequence<int, Is...>) { return (g<Is>(x) + ...); }
extern "C" __global__ void slow(float* x) { x[0] = sum(x[0], std::make_integer_sequence<int, 2000>{}); }
"""


def have(kind: str) -> bool:
    """Whether a compiler for ``kind`` ("cpp", "cuda", "hip") is found here."""
    try:
        _compiler.find(kind, None)
    except CompilerNotFound:
        return False
    return True


needs_cpp = pytest.mark.skipif(not have("cpp"), reason="no C++ compiler (c++, g++, clang++) on PATH")
needs_nvcc = pytest.mark.skipif(not have("cuda"), reason="no nvcc (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)")
needs_hipcc = pytest.mark.skipif(not have("hip"), reason="no hipcc (ROCM_PATH, HIP_PATH, PATH, /opt/rocm)")


# -- the processes a compile starts -------------------------------------------------------


def processes() -> list[tuple[int, int, str, str]]:
    """(pid, process group, name, command line) of every live process (zombies are gone)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        state, _, group = stat[stat.rindex(")") + 2:].split()[:3]
        if state != "Z":
            found.append((int(entry), int(group), name, cmdline))
    return found


def in_group(group: int) -> list[tuple[int, str]]:
    """(pid, name) of the live processes of a process group."""
    return [(pid, name) for pid, pgid, name, _ in processes() if pgid == group]


def marked(marker: str) -> list[tuple[int, str]]:
    """(pid, name) of the live processes whose command line holds ``marker``."""
    return [(pid, name) for pid, _, name, cmdline in processes() if marker in cmdline]


async def compiler_running(marker: str, programs: set[str]) -> tuple[int, set[str]]:
    """Wait until the compiler whose command line holds ``marker`` runs every one of
    ``programs`` at once; returns its process group (the worker's) and the names of the
    processes seen in it."""
    seen: set[str] = set()
    while True:
        driver = next((pgid for pid, pgid, name, cmdline in processes() if marker in cmdline), None)
        if driver is not None:
            names = {name for _, name in in_group(driver)}
            seen |= names
            if programs <= names:
                return driver, seen
        await anyio.sleep(0.02)
