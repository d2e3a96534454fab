"""JIT warm-up without a GPU: the specialisation is the JIT's own, and a primed JIT
compiles nothing. A stand-in driver reports an H100 so that Triton's JIT runs its real
code on this machine (it compiles for that target on the CPU; nothing is launched)."""

import pytest
from triton_kernels import ADD_SIGNATURE, add_kernel, axpy_kernel

import aiocompile
from aiocompile.backends.triton import _warmup as _triton_warmup

torch = pytest.importorskip("torch", reason="example tensors come from torch")


class StandInDriver:
    """What Triton's JIT asks of a driver before it launches: the device, its target and
    a stream."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        assert device == 0

    def get_current_stream(self, device=None):
        return 0


@pytest.fixture
def stand_in_driver():
    from triton.runtime import driver

    previous = driver._active  # reset_active() would look for a real driver, and find none here
    driver.set_active(StandInDriver())
    try:
        yield
    finally:
        driver._active = previous


@pytest.fixture
def jit_compiles():
    """Every compile Triton's JIT starts, as (kernel name, its JIT key), from its own hook."""
    from triton import knobs

    seen = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        seen.append((fn.name, key))
        return False  # go on and compile

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous


def forget_jit_cache(kernel):
    kernel.device_caches.clear()


@pytest.fixture(autouse=True)
def leave_the_jit_caches_as_found():
    # Entries made under the stand-in driver must not reach tests that launch for real.
    yield
    for kernel in (add_kernel, axpy_kernel):
        forget_jit_cache(kernel)


x = torch.ones(4096)
half = torch.ones(4096, dtype=torch.float16)
# A view one element in: its address is no longer a multiple of 16.
shifted = torch.ones(4097)[1:]

LAUNCHES = {
    "n not a multiple of 16": (add_kernel, (x, x, x, 1000), {"BLOCK": 1024}),
    "n a multiple of 16": (add_kernel, (x, x, x, 4096), {"BLOCK": 1024}),
    "n equal to 1": (add_kernel, (x, x, x, 1), {"BLOCK": 128}),
    "an option": (add_kernel, (x, x, x, 4096), {"BLOCK": 256, "num_warps": 2}),
    "fp16 tensors": (add_kernel, (half, half, half, 4096), {"BLOCK": 1024}),
    "a misaligned pointer": (add_kernel, (shifted, x, x, 4096), {"BLOCK": 1024}),
    "a float scalar and a default constexpr": (axpy_kernel, (x, x, x, 2.5, 4096), {"BLOCK": 512}),
    "a constexpr given": (axpy_kernel, (x, x, x, 2.5, 4096), {"BLOCK": 512, "SQUARE": True}),
    # A torch dtype stands for a tensor of that type (Triton's MockTensor).
    "a dtype for a tensor": (add_kernel, (torch.float32, torch.float32, torch.float32, 64), {"BLOCK": 64}),
}


@pytest.mark.parametrize("case", list(LAUNCHES))
async def test_warmup_compiles_what_the_jit_would_and_primes_it(case, scheduler, stand_in_driver, jit_compiles):
    kernel, args, kwargs = LAUNCHES[case]
    # What the JIT itself compiles for this launch, in this process:
    forget_jit_cache(kernel)
    reference = kernel.warmup(*args, grid=(1,), **kwargs)
    assert len(jit_compiles) == 1
    forget_jit_cache(kernel)
    jit_compiles.clear()

    plan = _triton_warmup.plan(kernel, args, kwargs)
    compiled = await scheduler.compile_triton(plan.fn, **plan.request())
    # The same specialisation: the same Triton hash, and so the same binary.
    assert compiled.key == reference.hash
    assert compiled.asm["ptx"] == reference.asm["ptx"]
    assert plan.jit_key == jit_compiles_key(kernel, args, kwargs)

    primed = _triton_warmup.prime(plan, compiled, load=False)
    launched = kernel.warmup(*args, grid=(1,), **kwargs)
    assert jit_compiles == []  # the JIT found it: no compile, not even a look for one
    assert launched is primed
    assert launched.hash == reference.hash


def jit_compiles_key(kernel, args, kwargs):
    """The JIT's key for a launch, as its own hook reports it."""
    from triton import knobs

    seen = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["key"]) or True  # True: skip the compile
    try:
        saved = dict(kernel.device_caches)
        forget_jit_cache(kernel)
        kernel.warmup(*args, grid=(1,), **kwargs)
    finally:
        knobs.runtime.jit_cache_hook = previous
        kernel.device_caches.clear()
        kernel.device_caches.update(saved)
    (key,) = seen
    return key


async def test_another_specialisation_still_compiles(scheduler, stand_in_driver, jit_compiles):
    forget_jit_cache(add_kernel)
    plan = _triton_warmup.plan(add_kernel, (x, x, x, 4096), {"BLOCK": 1024})
    _triton_warmup.prime(plan, await scheduler.compile_triton(plan.fn, **plan.request()), load=False)
    add_kernel.warmup(x, x, x, 4096, grid=(1,), BLOCK=1024)
    assert jit_compiles == []
    add_kernel.warmup(x, x, x, 1000, grid=(1,), BLOCK=1024)  # n no longer a multiple of 16
    assert len(jit_compiles) == 1


async def test_warmup_for_an_explicit_target_compiles_without_priming(scheduler):
    kernel = await scheduler.warmup(add_kernel, x, x, x, 4096, grid=(4,), target="hip:gfx942", BLOCK=1024)
    assert kernel.target == "hip:gfx942" and "amdgcn" in kernel.asm
    assert dict(kernel.signature) == {**ADD_SIGNATURE, "BLOCK": "constexpr"}
    again = await aiocompile.warmup(add_kernel, x, x, x, 4096, grid=lambda meta: (4,), target="hip:gfx942",
                                    BLOCK=1024)
    assert again.key == kernel.key


async def test_warmup_refuses_what_is_not_a_plain_jit_function(scheduler):
    import triton

    tuned = triton.autotune(configs=[triton.Config({"BLOCK": 128})], key=["n"])(add_kernel)
    with pytest.raises(TypeError, match="configuration at launch time"):
        await scheduler.warmup(tuned, x, x, x, 4096, target="cuda:90")
    with pytest.raises(TypeError, match="@triton.jit"):
        await scheduler.warmup(len, x, target="cuda:90")
    with pytest.raises(TypeError, match="grid"):
        await scheduler.warmup(add_kernel, x, x, x, 4096, grid="everywhere", target="cuda:90", BLOCK=64)
    with pytest.raises(TypeError, match="add_kernel"):
        await scheduler.warmup(add_kernel, x, x, target="cuda:90", BLOCK=64)  # too few arguments
    with pytest.raises(KeyError):
        await scheduler.warmup(add_kernel, x, x, x, 64, target="cuda:90", BLOCK=64, no_such_option=1)
