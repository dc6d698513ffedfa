"""Linear weights stored column-major on the CPU (mlx_spec/platform/weight_layout.py)."""

import mlx_spec
from mlx_spec.platform import weight_layout

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


class _Wide(nn.Module):
    """Linear weights of just over 4 MiB in all: big enough to be timed."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 512)
        self.layers = [nn.Linear(512, 1024), nn.Linear(1024, 512)]
        self.head = nn.Linear(512, 64, bias=False)

    def __call__(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = nn.silu(layer(x))
        return self.head(x)


@pytest.fixture
def undecided(monkeypatch):
    """No layout decided yet in this process, and none pinned by the environment."""
    monkeypatch.delenv(weight_layout.ENV, raising=False)
    monkeypatch.setitem(weight_layout._decision, "layout", None)


def test_the_layouts_are_timed_and_the_weights_left_as_loaded(undecided):
    net = _Wide()
    mx.eval(net.parameters())
    layers = weight_layout._linears(net)
    before = [layer.weight for layer in layers]
    row, column = weight_layout._measure(net, layers)
    assert row > 0 and column > 0
    assert all(layer.weight is w for layer, w in zip(layers, before, strict=True))
    assert all(memoryview(w).c_contiguous for w in before)


@pytest.mark.parametrize(("row", "column", "kept"), [(1.0, 2.0, "row"), (2.0, 1.0, "column")])
def test_the_faster_layout_is_kept_for_every_model_after(undecided, monkeypatch, row, column, kept):
    timed = []
    monkeypatch.setattr(
        weight_layout, "_measure", lambda model, layers: timed.append(model) or (row, column)
    )
    net = _Wide()
    ids = mx.array([[1, 2, 3]])
    want = net(ids)
    assert weight_layout.decide(net) == kept
    rounds = 2 if kept == "column" else 1  # column-major: a second round agreed
    assert weight_layout.decide(_Wide()) == kept and len(timed) == rounds  # once per process
    rewritten = weight_layout.column_major(net)
    assert rewritten == (3 if kept == "column" else 0)
    assert all(_column_major(x.weight) == (kept == "column") for x in weight_layout._linears(net))
    assert mx.allclose(net(ids), want, rtol=1e-5, atol=1e-6).item()
    small = _Net()  # a drafter loaded later follows the decision
    assert weight_layout.column_major(small) == (3 if kept == "column" else 0)
    # a tie within 1% keeps column-major
    monkeypatch.setitem(weight_layout._decision, "layout", None)
    monkeypatch.setattr(weight_layout, "_measure", lambda model, layers: (0.995, 1.0))
    assert weight_layout.decide(_Wide()) == "column"


@pytest.mark.parametrize(
    ("rounds", "kept"),
    [
        ([(1.0, 0.9), (1.0, 0.9)], "column"),  # two rounds agree: rewritten
        ([(1.0, 0.9), (0.9, 1.0)], "row"),  # the second disagrees: kept as loaded
        ([(0.9, 1.0)], "row"),  # as loaded is clearly faster: one round
    ],
)
def test_column_major_wants_a_second_round_to_agree(undecided, monkeypatch, rounds, kept):
    left = list(rounds)
    monkeypatch.setattr(weight_layout, "_measure", lambda model, layers: left.pop(0))
    assert weight_layout.decide(_Wide()) == kept
    assert not left  # every round given was timed, and no more


def test_what_is_not_timed(undecided, monkeypatch):
    monkeypatch.setattr(weight_layout, "_measure", lambda model, layers: pytest.fail("timed"))
    assert weight_layout.decide(_Net()) is None  # a few KiB of weights: column-major
    monkeypatch.setattr(weight_layout, "MAX_TIMED", 1 << 20)
    assert weight_layout.decide(_Wide()) is None  # more than the bound: not held twice
    monkeypatch.setattr(weight_layout, "MAX_TIMED", 2 << 30)
    for pinned in ("column", "0"):
        monkeypatch.setenv(weight_layout.ENV, pinned)
        assert weight_layout.decide(_Wide()) is None
    assert weight_layout._decision["layout"] is None


def test_a_model_slower_than_the_limit_is_not_timed(undecided, monkeypatch):
    monkeypatch.setattr(weight_layout, "PASS_LIMIT", 0.0)
    net = _Wide()
    assert weight_layout.decide(net) is None
    assert weight_layout._decision["layout"] is None
    assert all(memoryview(x.weight).c_contiguous for x in weight_layout._linears(net))
