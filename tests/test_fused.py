"""RoPE and RMSNorm in fewer ops on the CPU (mlx_spec/platform/fused.py): bitwise MLX's own
results."""

import io
import re

from mlx_spec.caches.batch import BatchCache
from mlx_spec.platform import fused

import mlx.core as mx
import pytest

pytestmark = pytest.mark.skipif(
    not fused._state["installed"], reason="the fused ops are installed on Linux only"
)
ORIGINAL_ROPE = fused._state["rope"]
ORIGINAL_RMS_NORM = fused._state["rms_norm"]


def _ops(out: mx.array) -> int:
    text = io.StringIO()
    mx.export_to_dot(text, out)
    return len(re.findall(r'label ="[A-Za-z]', text.getvalue()))


@pytest.mark.parametrize("shape", [(1, 4, 1, 64), (3, 2, 5, 32), (2, 3, 40, 128)])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("partial", [False, True])
def test_rope_is_bitwise_mlx_own(shape, traditional, partial):
    x = mx.random.normal(shape, key=mx.random.key(sum(shape)))
    dims = shape[-1] // 2 if partial else shape[-1]
    rows = shape[0]
    offsets = [0, 37, mx.array(11), mx.array([5 * i + 3 for i in range(rows)])]
    settings = [
        {"base": 10000.0, "scale": 1.0, "freqs": None},
        {"base": 500000.0, "scale": 0.25, "freqs": None},
        {"base": None, "scale": 1.0, "freqs": mx.random.uniform(1, 1000, (dims // 2,))},
    ]
    for offset in offsets:
        for kw in settings:
            want = ORIGINAL_ROPE(x, dims, traditional=traditional, offset=offset, **kw)
            mine = offset
            if isinstance(offset, mx.array) and offset.size > 1:
                mine = fused.stable(mx.array(offset))
            for _ in range(2):  # the second call at a registered offset reuses its angles
                got = mx.fast.rope(x, dims, traditional=traditional, offset=mine, **kw)
                assert mx.array_equal(got, want).item(), (offset, kw)


def test_rope_angles_are_shared_only_at_registered_offsets():
    x = mx.random.normal((2, 3, 4, 16))
    kw = {"traditional": False, "base": 10000.0, "scale": 1.0}
    # An array updated in place keeps its identity: unregistered, it is never trusted.
    offset = mx.array([3, 9])
    mx.fast.rope(x, 16, offset=offset, **kw)
    offset += 5
    want = ORIGINAL_ROPE(x, 16, offset=mx.array([8, 14]), **kw)
    assert mx.array_equal(mx.fast.rope(x, 16, offset=offset, **kw), want).item()
    # A registered one shares one graph of angles between calls: a pass's second RoPE at the
    # same positions adds only the rotation (the negative control: an unregistered copy).
    stable = fused.stable(mx.array([8, 14]))
    first = mx.fast.rope(x, 16, offset=stable, **kw)
    second = mx.fast.rope(x, 16, offset=stable, **kw)
    loose = mx.fast.rope(x, 16, offset=mx.array([8, 14]), **kw)
    both = _ops(first + second)
    assert both - _ops(first) < _ops(loose + first) - _ops(first)
    assert mx.array_equal(second, want).item()


def test_fused_ops_build_smaller_graphs():
    x = mx.random.normal((8, 6, 4, 64))
    w = mx.random.normal((64,))
    offset = fused.stable(mx.array(list(range(100, 108))))
    kw = {"traditional": False, "base": 10000.0, "scale": 1.0, "offset": offset}
    assert _ops(mx.fast.rope(x, 64, **kw)) < _ops(ORIGINAL_ROPE(x, 64, **kw))
    assert _ops(mx.fast.rms_norm(x, w, 1e-5)) < _ops(ORIGINAL_RMS_NORM(x, w, 1e-5))
    with fused.disabled():
        assert _ops(mx.fast.rope(x, 64, **kw)) == _ops(ORIGINAL_ROPE(x, 64, **kw))


@pytest.mark.parametrize("shape", [(7,), (3, 64), (2, 5, 384)])
def test_rms_norm_is_bitwise_mlx_own(shape):
    x = mx.random.normal(shape, key=mx.random.key(len(shape)))
    w = mx.random.normal(shape[-1:], key=mx.random.key(9))
    for weight in (None, w):
        want = ORIGINAL_RMS_NORM(x, weight, 1e-5)
        assert mx.array_equal(mx.fast.rms_norm(x, weight, 1e-5), want).item()


def test_gradients_match_mlx_own():
    x = mx.random.normal((2, 3, 4, 16))
    w = mx.random.normal((16,))
    offset = fused.stable(mx.array([2, 7]))

    def loss(rope, norm):
        def f(x, w):
            y = rope(x, 16, traditional=False, base=10000.0, scale=1.0, offset=offset)
            return (norm(y, w, 1e-5) ** 2).sum()

        return f

    ours = mx.grad(loss(mx.fast.rope, mx.fast.rms_norm), argnums=(0, 1))(x, w)
    theirs = mx.grad(loss(ORIGINAL_ROPE, ORIGINAL_RMS_NORM), argnums=(0, 1))(x, w)
    for a, b in zip(ours, theirs, strict=True):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-6).item()


def test_inside_compile():
    x = mx.random.normal((1, 2, 3, 8))

    @mx.compile
    def f(x):
        return mx.fast.rope(x, 8, traditional=False, base=1234.5, scale=1.0, offset=5)

    want = ORIGINAL_ROPE(x, 8, traditional=False, base=1234.5, scale=1.0, offset=5)
    assert mx.allclose(f(x), want).item()


def test_other_dtypes_go_to_mlx():
    x = mx.random.normal((1, 2, 3, 8)).astype(mx.float16)
    want = ORIGINAL_ROPE(x, 8, traditional=False, base=10000.0, scale=1.0, offset=2)
    got = mx.fast.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=2)
    assert got.dtype == mx.float16 and mx.array_equal(got, want).item()
    assert _ops(got) == _ops(want)


def test_the_batch_cache_registers_its_offsets(loaded):
    model = loaded["llama"][0]
    cache = BatchCache(model, 2)
    cache.begin([3, 2])
    model(mx.array([[1, 2, 3], [4, 5, 0]]), cache=cache.layers)
    cache.end([3, 2])
    offset = cache.layers[0].offset
    assert fused._stable.get(id(offset)) is offset
    assert offset.tolist() == [3, 2]
