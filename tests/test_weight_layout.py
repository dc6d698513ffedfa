"""Linear weights stored column-major on the CPU (mlx_spec/weight_layout.py)."""

import mlx_spec
from mlx_spec import weight_layout

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

pytestmark = pytest.mark.skipif(
    mx.default_device().type != mx.cpu, reason="the layout is rewritten on the CPU only"
)


def _column_major(a: mx.array) -> bool:
    view = memoryview(a)
    return view.f_contiguous and not view.c_contiguous


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 24)
        self.down = nn.Linear(24, 16, bias=False)
        self.head = nn.Linear(16, 32, bias=False)

    def __call__(self, ids):
        return self.head(self.down(nn.silu(self.up(self.embed(ids)))))


def test_linear_weights_become_column_major_with_the_same_values(tmp_path):
    net = _Net()
    net.spare = nn.Linear(16, 32, bias=False)
    net.head.weight = net.spare.weight  # two layers holding one array (tied weights)
    mx.eval(net.parameters())
    before = dict(tree_flatten(net.parameters()))
    ids = mx.array([[1, 5, 7, 30]])
    want = net(ids)
    assert weight_layout.column_major(net) == 3  # up, down, and the shared head once
    after = dict(tree_flatten(net.parameters()))
    for name, value in before.items():
        assert mx.array_equal(after[name], value).item(), name
    for layer in (net.up, net.down, net.head, net.spare):
        assert _column_major(layer.weight)
    assert net.head.weight is net.spare.weight  # still one array
    assert memoryview(net.embed.weight).c_contiguous  # lookups read rows: left as it was
    assert mx.allclose(net(ids), want, rtol=1e-5, atol=1e-6).item()
    # saved and read back: the same logical tensors
    mx.save_safetensors(str(tmp_path / "w.safetensors"), after)
    for name, value in mx.load(str(tmp_path / "w.safetensors")).items():
        assert mx.array_equal(value, before[name]).item(), name
    assert weight_layout.column_major(net) == 3  # again: no copies, nothing changes
    assert all(_column_major(layer.weight) for layer in (net.up, net.down, net.head))


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(weight_layout.ENV, "0")
    net = _Net()
    assert weight_layout.column_major(net) == 0
    assert memoryview(net.up.weight).c_contiguous


def test_loaded_models_get_it(checkpoints, monkeypatch):
    target_dir, _ = checkpoints["llama"]
    model, _ = mlx_spec.load(str(target_dir))
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears and all(_column_major(m.weight) for m in linears)
    monkeypatch.setenv(weight_layout.ENV, "0")
    plain, _ = mlx_spec.load(str(target_dir))
    ids = mx.array([[3, 4, 5, 6, 7]])
    assert mx.allclose(model(ids), plain(ids), rtol=1e-4, atol=1e-5).item()
    assert all(
        memoryview(m.weight).c_contiguous
        for _, m in plain.named_modules()
        if isinstance(m, nn.Linear)
    )
