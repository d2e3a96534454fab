"""Recording a call's convolutions and making them again, one at a time, in another thread
(``aiocompile._torch.thread_plans``): what the serving thread does after a switch so that the
compiled version's first call there has no per-thread plans left to make. On the CPU here
(the GPU's cuDNN is what needs it; the recording and the replay are the same)."""

from __future__ import annotations

import collections
import threading

import pytest

torch = pytest.importorskip("torch")

from aiocompile._torch import thread_plans  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1)).eval()


def test_each_distinct_convolution_is_recorded_once_with_its_tensors_shapes_and_nothing_else():
    model, x = _model(), torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    with torch.no_grad(), thread_plans.recording("cpu") as primes:
        model(x)
        model(x)  # the same convolutions again: nothing new
        torch.relu(x) + 1  # not a convolution
    assert len(primes) == 2
    assert {prime.op.overloadpacket.__name__ for prime in primes} <= thread_plans.CONVOLUTIONS
    first = primes[0].args[0]
    assert (first.size, first.stride, first.dtype) == (tuple(x.shape), tuple(x.stride()), x.dtype)


def test_nothing_on_another_device_or_in_another_thread_is_recorded():
    model, x = _model(), torch.randn(2, 3, 16, 16)
    with torch.no_grad(), thread_plans.recording("cuda") as on_gpu:
        model(x)
    assert on_gpu == []
    with torch.no_grad(), thread_plans.recording("cpu") as primes:
        other = threading.Thread(target=lambda: model(x))
        other.start()
        other.join()
    assert primes == []


def test_a_prime_makes_the_same_operator_call_on_empty_tensors_of_the_same_shapes():
    model, x = _model(), torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    with torch.no_grad(), thread_plans.recording("cpu") as primes:
        model(x)
    made: list[thread_plans.Prime] = []

    def replay() -> None:
        with thread_plans.recording("cpu") as again:
            for prime in primes:
                prime()
        made.extend(again)

    worker = threading.Thread(target=replay)
    worker.start()
    worker.join()
    assert [prime.key() for prime in made] == [prime.key() for prime in primes]


def test_make_next_makes_one_and_a_failure_ends_the_rest():
    calls: list[str] = []

    class Named(thread_plans.Prime):
        def __init__(self, name: str, fails: bool = False) -> None:
            super().__init__(op=name, args=(), kwargs={})
            self.fails = fails

        def __call__(self) -> None:
            calls.append(self.op)
            if self.fails:
                raise RuntimeError("out of memory")

    primes = collections.deque([Named("a"), Named("b", fails=True), Named("c")])
    thread_plans.make_next(primes)
    assert calls == ["a"] and len(primes) == 2
    thread_plans.make_next(primes)
    assert calls == ["a", "b"] and not primes  # the failure left nothing to make
    thread_plans.make_next(primes)  # nothing left: nothing happens
    assert calls == ["a", "b"]


class _Counted(thread_plans.Prime):
    def __init__(self, made: list[int]) -> None:
        super().__init__(op="counted", args=(), kwargs={})
        self.made = made

    def __call__(self) -> None:
        self.made.append(threading.get_ident())


def test_without_an_event_loop_each_is_made_at_once():
    made: list[int] = []
    primes = thread_plans.Primes()
    primes.extend([_Counted(made), _Counted(made)])
    primes.make_one()
    assert made == [threading.get_ident()] and primes
    primes.make_one()
    assert len(made) == 2 and not primes


async def test_in_an_event_loop_each_is_made_by_the_loop_after_the_step_or_by_the_next_call():
    import anyio

    made: list[int] = []
    primes = thread_plans.Primes()
    primes.extend([_Counted(made) for _ in range(4)])
    primes.make_one()
    assert made == []  # asked of the loop, not made in the call
    for _ in range(100):
        if made:
            break
        await anyio.sleep(0)
    assert made == [threading.get_ident()]
    primes.make_one()
    primes.make_one()  # the same step: makes the one asked for before
    assert len(made) == 2
    for _ in range(100):
        if len(made) == 3:
            break
        await anyio.sleep(0)
    assert made == [threading.get_ident()] * 3
    assert primes  # one left
