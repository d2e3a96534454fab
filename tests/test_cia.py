"""``_torch.cia``: torch's walk over its CompositeImplicitAutograd operators, made in
pieces that stand aside for a call being served, with the same result as torch's own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

torch = pytest.importorskip("torch")

from torch._export import utils as export_utils  # noqa: E402

from aiocompile._base import aside, threads  # noqa: E402
from aiocompile._torch import cia  # noqa: E402

# What a fresh process's torch.ops namespaces hold after one walk: each namespace's
# operator packets, and each packet's overloads made so far.
_WALKED = textwrap.dedent("""
    import json, sys
    import torch
    from torch._export import utils
    if sys.argv[1] == "pieces":
        from aiocompile._torch import cia
        with cia.in_pieces():
            utils._materialize_cpp_cia_ops()
    else:
        utils._materialize_cpp_cia_ops()
    held = {}
    for name in sorted(torch.ops._dir):
        namespace = getattr(torch.ops, name)
        held[name] = {packet: sorted(k for k in vars(getattr(namespace, packet)) if not k.startswith("_"))
                      for packet in sorted(namespace._dir)}
    print(json.dumps(held))
""")


def _walked(how: str) -> dict[str, dict[str, list[str]]]:
    done = subprocess.run([sys.executable, "-c", _WALKED, how], capture_output=True, text=True, timeout=240,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_walk_in_pieces_makes_what_torchs_own_makes():
    ours, theirs = _walked("pieces"), _walked("torch")
    assert ours == theirs
    assert sum(len(packets) for packets in ours.values()) > 100  # the walk made operators at all


def test_torchs_own_walk_is_back_after_the_last_block():
    original = export_utils._materialize_cpp_cia_ops
    with cia.in_pieces():
        assert export_utils._materialize_cpp_cia_ops is cia.materialize
        with cia.in_pieces():
            assert export_utils._materialize_cpp_cia_ops is cia.materialize
        assert export_utils._materialize_cpp_cia_ops is cia.materialize
    assert export_utils._materialize_cpp_cia_ops is original


def test_a_walk_put_there_by_someone_else_is_left_alone(monkeypatch):
    def theirs() -> None:
        pass

    monkeypatch.setattr(export_utils, "_materialize_cpp_cia_ops", theirs)
    with cia.in_pieces():
        assert export_utils._materialize_cpp_cia_ops is theirs
    assert export_utils._materialize_cpp_cia_ops is theirs


def _stood_aside_during_walks(monkeypatch, pieces: bool) -> tuple[int, int]:
    """With a call being served throughout, a thread that stands aside (inside
    ``handing_over``) walks torch's operators as the decompositions' import does, once per
    namespace: how often it stood aside inside the walk, and how many pieces there were."""
    inside_walk = [0]
    real = aside._stand_aside
    walkers = {f"{cia.__name__}.materialize", f"{export_utils.__name__}._materialize_cpp_cia_ops"}
    walker: list[int] = []

    def counting() -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if f"{frame.f_globals.get('__name__')}.{frame.f_code.co_name}" in walkers \
                    or frame.f_code.co_name == "_lookup":
                if threading.get_ident() in walker:
                    inside_walk[0] += 1
                break
            frame = frame.f_back
        real()

    monkeypatch.setattr(aside, "_stand_aside", counting)
    # Standing aside needs no budget here: it is counted, not waited for.
    monkeypatch.setattr(aside, "STAND_ASIDE_MAX", 0.0)

    def walk() -> None:
        walker.append(threading.get_ident())
        with threads.handing_over(), (cia.in_pieces() if pieces else _nothing()):
            export_utils._materialize_cpp_cia_ops()

    export_utils._materialize_cpp_cia_ops()  # the operators exist: only lookups are left
    aside.serve_begin()
    try:
        thread = threading.Thread(target=walk)
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
    finally:
        aside.serve_end()
    count = len(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))
    return inside_walk[0], -(-count // cia.PIECE)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_walk_in_pieces_stands_aside_at_each_piece(monkeypatch):
    stood, pieces = _stood_aside_during_walks(monkeypatch, pieces=True)
    assert pieces > 1
    assert stood >= pieces


def test_torchs_own_walk_does_not_stand_aside_inside(monkeypatch):
    # What the pieces are for: torch's loop makes only C calls once its operators exist.
    stood, _ = _stood_aside_during_walks(monkeypatch, pieces=False)
    assert stood <= 1  # at most as it begins
