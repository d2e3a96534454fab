import pytest

from aiocompile._base.target import Target, parse_target


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cuda:80", Target("cuda", 80, 32)),
        ("cuda:90", Target("cuda", 90, 32)),
        ("cuda:sm_90", Target("cuda", 90, 32)),
        ("cuda:90a", Target("cuda", 90, 32)),
        ("cuda:100", Target("cuda", 100, 32)),
        ("cuda:120", Target("cuda", 120, 32)),
        ("hip:gfx942", Target("hip", "gfx942", 64)),
        ("hip:gfx1100", Target("hip", "gfx1100", 32)),
        ("HIP:GFX90A", Target("hip", "gfx90a", 64)),
        ("cuda:90:32", Target("cuda", 90, 32)),
        ("hip:gfx942:32", Target("hip", "gfx942", 32)),
        ("hip:gfx1100:64", Target("hip", "gfx1100", 64)),
    ],
)
def test_parse(text, expected):
    assert parse_target(text) == expected
    assert str(parse_target(text)) == f"{expected.backend}:{expected.arch}"


@pytest.mark.parametrize("text", ["cuda", "cuda:", "cuda:9x", "opencl:1", "hip:sm90", "gfx942", "cuda:90:x", "",
                                  "cuda:90:7", "cuda:90:0", "cuda:90:64", "hip:gfx942:48", "hip:gfx942:0"])
def test_unknown_target_strings_raise_value_error(text):
    with pytest.raises(ValueError):
        parse_target(text)


def test_gpu_target_and_none():
    from triton.backends.compiler import GPUTarget

    assert parse_target(GPUTarget("cuda", 90, 32)) == Target("cuda", 90, 32)
    assert parse_target(None) is None
    assert parse_target(Target("hip", "gfx942", 64)).to_gpu_target() == GPUTarget("hip", "gfx942", 64)
    with pytest.raises(TypeError):
        parse_target(90)


def test_a_warp_size_that_is_not_the_vendors_is_refused_however_given():
    from triton.backends.compiler import GPUTarget

    with pytest.raises(ValueError, match="warp size of target cuda:90 must be 32, got 7"):
        parse_target("cuda:90:7")
    with pytest.raises(ValueError, match="warp size of target hip:gfx942 must be 32 or 64, got 48"):
        parse_target("hip:gfx942:48")
    with pytest.raises(ValueError, match="warp size"):
        parse_target(GPUTarget("cuda", 90, 16))
    with pytest.raises(ValueError, match="warp size"):
        Target("hip", "gfx942", 128)
    with pytest.raises(TypeError, match="warp size"):
        Target("cuda", 90, True)
