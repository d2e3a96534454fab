"""Packing a model for a worker (``aiocompile/_torch/parcel.py``): by reference
or by value, and the interpreter lock offered to the serving thread before each tensor."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")

import background_models  # noqa: E402  (needs torch)

from aiocompile._torch import parcel as _parcel  # noqa: E402


class Counting:
    """Stands in for the ``time`` module in ``_parcel``: counts the lock's offers."""

    def __init__(self) -> None:
        self.offers = 0

    def sleep(self, seconds: float) -> None:
        assert seconds == 0
        self.offers += 1


def tensors_of(model: torch.nn.Module) -> int:
    return len(list(model.parameters())) + len(list(model.buffers()))


@pytest.mark.parametrize("how", ["reference", "cloudpickle"])
def test_packing_offers_the_lock_before_each_tensor_and_round_trips(monkeypatch, how):
    if how == "cloudpickle":
        pytest.importorskip("cloudpickle")

        class Local(torch.nn.Module):  # local to the test: only cloudpickle takes it
            def __init__(self) -> None:
                super().__init__()
                self.inner = background_models.MLP()
                self.register_buffer("scale", torch.full((16,), 2.0))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.inner(x) * self.scale

        model: torch.nn.Module = Local()
    else:
        model, _ = background_models.make_mlp()
    counting = Counting()
    monkeypatch.setattr(_parcel, "time", counting)
    parcel = _parcel.pack(model)
    assert parcel.how == how
    assert counting.offers >= tensors_of(model) > 0  # a parameter offers twice: itself, then its data
    monkeypatch.undo()
    copy = _parcel.unpack(parcel)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=0, atol=0)



def in_main(monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """A model whose class lives in ``__main__``, as one defined in a program's script."""

    class Scaled(background_models.MLP):
        pass

    Scaled.__module__ = "__main__"
    Scaled.__qualname__ = "Scaled"
    monkeypatch.setattr(sys.modules["__main__"], "Scaled", Scaled, raising=False)
    return Scaled().eval()


def test_a_class_of_main_travels_by_value_and_no_script_goes_with_it(monkeypatch):
    pytest.importorskip("cloudpickle")
    model = in_main(monkeypatch)
    parcel = _parcel.pack(model)
    assert parcel.how == "cloudpickle"
    monkeypatch.delattr(sys.modules["__main__"], "Scaled")  # a worker's __main__ has no such class
    copy = _parcel.unpack(parcel)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=0, atol=0)


def test_without_cloudpickle_a_class_of_main_is_refused_saying_what_to_change(monkeypatch):
    model = in_main(monkeypatch)
    monkeypatch.setitem(sys.modules, "cloudpickle", None)  # import cloudpickle raises ImportError
    with pytest.raises(TypeError, match=r"Scaled defined in the program's __main__.*move its class into an "
                                        r"importable module"):
        _parcel.pack(model)


class Shared(torch.nn.Module):
    """Weights of several kinds: a large one, a bfloat16 one, a frozen parameter, a buffer
    and a transposed view of another parameter's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(512, 256))  # 512 KiB
        self.brain = torch.nn.Parameter(torch.randn(8, 4).to(torch.bfloat16))
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("transposed", self.table.detach().t())


def test_the_weights_go_beside_the_pickle_uncopied_and_come_back_as_they_were():
    """Each storage's bytes are a buffer of the parcel, not part of its pickle; on the CPU
    they are the storage's own memory. Unpickled (torch alone needed), every tensor is
    equal, of its dtype, device and strides, parameters keep ``requires_grad``, and views
    of one storage are views of one storage again."""
    import ctypes
    import pickle

    model = Shared()
    parcel = _parcel.pack(model)
    assert parcel.how == "reference" and len(parcel.data) < 16 * 1024
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    assert sorted(memoryview(w).nbytes for w in parcel.weights) == sorted(storages.values())
    assert parcel.size == len(parcel.data) + sum(storages.values())
    addresses = {ctypes.addressof(ctypes.c_ubyte.from_buffer(w.obj)) for w in parcel.weights if len(w)}
    assert addresses == set(storages)  # the model's own memory

    for copy in (_parcel.unpack(parcel),
                 # As other executors and the repro bundle get it: everything in one pickle.
                 _parcel.unpack(pickle.loads(pickle.dumps(parcel, protocol=4))),
                 _parcel.unpack(pickle.loads(pickle.dumps(parcel, protocol=5)))):
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            again = getattr(copy, name)
            assert type(again) is type(tensor) and again.dtype == tensor.dtype and again.stride() == tensor.stride()
            assert again.requires_grad == tensor.requires_grad and again.device == tensor.device
            torch.testing.assert_close(again, tensor, rtol=0, atol=0)
        assert copy.transposed.untyped_storage().data_ptr() == copy.table.untyped_storage().data_ptr()
    assert _parcel.digest(parcel) != _parcel.digest(_parcel.pack(Shared()))


def test_a_model_sent_by_value_puts_its_weights_beside_the_pickle_too(monkeypatch):
    pytest.importorskip("cloudpickle")
    model = in_main(monkeypatch)
    parcel = _parcel.pack(model)
    assert parcel.how == "cloudpickle"
    weights = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
    assert sum(memoryview(w).nbytes for w in parcel.weights) == weights > 0
    monkeypatch.delattr(sys.modules["__main__"], "Scaled")
    copy = _parcel.unpack(parcel)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(copy(x), model(x), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_models_weights_are_copied_to_the_host_and_placed_back_on_its_device():
    model = Shared().cuda()
    parcel = _parcel.pack(model)
    assert len(parcel.data) < 16 * 1024
    assert sum(memoryview(w).nbytes for w in parcel.weights) == \
        sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
    copy = _parcel.unpack(parcel)
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        again = getattr(copy, name)
        assert again.device == tensor.device and again.dtype == tensor.dtype and again.stride() == tensor.stride()
        torch.testing.assert_close(again, tensor, rtol=0, atol=0)
    # (``.cuda()`` moved the buffer and the parameter apart: they share no storage now.)
    def shared(module: torch.nn.Module) -> bool:
        return module.transposed.untyped_storage().data_ptr() == module.table.untyped_storage().data_ptr()

    assert shared(copy) == shared(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_models_weights_written_just_before_packing_are_packed_as_written():
    """The copies run on a stream of their own (the serving thread's later kernels do not
    wait behind them), after what the current stream held when the packing began: a
    write queued behind a tenth of a second of work is in the parcel."""
    model = torch.nn.Linear(1024, 1024).cuda()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):  # queued, not yet run, when the packing begins
        busy = torch.tanh(busy @ busy)
    with torch.no_grad():
        model.weight.fill_(3.0)
        model.bias.copy_(busy[0, :1024] * 0 + 7.0)
    copy = _parcel.unpack(_parcel.pack(model))
    assert bool((copy.weight == 3.0).all()) and bool((copy.bias == 7.0).all())
    assert copy.weight.device == model.weight.device
