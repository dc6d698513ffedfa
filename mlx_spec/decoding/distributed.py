"""A target sharded over several processes with `mx.distributed` (MLX's ring, JACCL or MPI
backends, started by `mlx.launch`).

Every rank runs the same decode loop on its shard of the target (tensor parallel: every layer
split across ranks; pipeline parallel: each rank a stretch of layers) and the same replicated
drafter. The collectives inside the target's forward pass leave the logits and final hidden
states equal on every rank; what could still differ between ranks (a policy's choice, which
rests on each rank's own clock; a random draw) is decided on rank 0 and shared, so every rank
feeds the same drafts, accepts the same count and rolls back by the same amount:

- `Sync.share` (inside the graph, no extra synchronisation): the drafts before the target pass,
  the accepted count and next token after it, each plain step's token;
- `Sync.share_ints` (one small collective, evaluated): the round's choice and the seed.

Communication is accounted for by `CommLedger`: the collectives of every pass are counted as
the graph is built (the `mx.distributed` functions are wrapped once per process), and each is
priced by a probe of the same size over the same group, timed at start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

SHARD_MODES = ("auto", "tensor", "pipeline")
# Architectures mlx-lm loads but has no `shard` for, whose layers are Llama's (q/k/v/o, a
# gate/up/down MLP) and are split here as mlx-lm splits Llama. Others are refused rather than
# guessed at (a gated query projection or a K/V cache read by a drafter would split wrongly).
LLAMA_LAYOUT = frozenset({"mimo"})
SHARDING_ATTR = "_mlx_spec_sharding"  # on a sharded target: its `Sharding`
UNSHARDED_ATTR = "_mlx_spec_unsharded"  # on a sharded target: the whole (lazy) model
MIN_SHARED = 8  # elements a shared array is padded to (see `Sync.share`)
_LAUNCH_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MLX_JACCL_COORDINATOR")


class DistributedError(RuntimeError):
    """A distributed run cannot go on (a rank is gone, ranks disagree)."""


def launched() -> bool:
    """Whether this process was started by a distributed launcher (`mlx.launch`, mpirun)."""
    return any(name in os.environ for name in _LAUNCH_VARS)


def world() -> mx.distributed.Group | None:
    """The group of processes this one was launched with, or None when it runs alone."""
    if not launched():
        return None
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as exc:
        raise DistributedError(f"cannot join the distributed group: {exc}") from exc
    return group if group.size() > 1 else None


@dataclass
class Sharding:
    """How a target was split: the group, and "tensor" or "pipeline"."""

    group: mx.distributed.Group
    mode: str

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def sharding_of(model: nn.Module) -> Sharding | None:
    """The sharding of a target loaded with `mlx_spec.load(..., shard=...)`, else None."""
    return getattr(model, SHARDING_ATTR, None)


def whole(model: nn.Module) -> nn.Module:
    """The unsharded model behind a sharded target (lazy: only what a drafter borrows, such as
    one decoder layer to copy, the embedding or the head, is ever read), else the model."""
    return getattr(model, UNSHARDED_ATTR, model)


# --- sharding a target -----------------------------------------------------------------------


def pipeline_module(model: nn.Module):
    """The inner model that mlx-lm can split into pipeline stages, or None."""
    for candidate in (getattr(model, "model", None), getattr(model, "language_model", None)):
        inner = getattr(candidate, "model", candidate)
        for module in (candidate, inner):
            if module is not None and callable(getattr(module, "pipeline", None)):
                return module
    return None


def _dense_layers(model: nn.Module) -> list | None:
    """The decoder layers when every one has the Llama layout (q/k/v/o projections with
    `n_heads`/`n_kv_heads`, a gate/up/down MLP), else None."""
    layers = list(getattr(model, "layers", []) or [])
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads")
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in names):
            return None
        projections = ("gate_proj", "up_proj", "down_proj")
        if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in projections):
            return None
    return layers or None


def _shard_dense(layers: list, group: mx.distributed.Group, model_type: str) -> None:
    """Tensor parallelism for Llama-layout layers, as mlx-lm shards Llama: heads and MLP
    columns split across ranks, one all-sum after attention and one after the MLP."""
    from mlx.nn.layers.distributed import shard_linear

    n = group.size()
    for layer in layers:
        attn = layer.self_attn
        if attn.n_heads % n or attn.n_kv_heads % n:
            raise ValueError(
                f"cannot shard {model_type} over {n} ranks: {attn.n_heads} attention heads and "
                f"{attn.n_kv_heads} key/value heads must both divide by {n}"
            )
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= n
        attn.n_kv_heads //= n
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_target(model: nn.Module, group: mx.distributed.Group, mode: str = "auto") -> str:
    """Split `model` over `group` in place; returns the mode used ("tensor" or "pipeline").

    Tensor parallel uses mlx-lm's `shard` where the architecture has one, else the Llama layout
    (for architectures such as MiMo that mlx-lm loads but does not shard); pipeline parallel
    uses mlx-lm's `pipeline`. "auto" prefers tensor parallel.
    """
    if mode not in SHARD_MODES:
        raise ValueError(f"unknown shard mode {mode!r}: pass one of {', '.join(SHARD_MODES)}")
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    has_shard = callable(getattr(model, "shard", None))
    dense = None if has_shard or model_type not in LLAMA_LAYOUT else _dense_layers(model)
    pipe = pipeline_module(model)
    tensor_ok = has_shard or dense is not None
    if mode == "auto":
        mode = "tensor" if tensor_ok else "pipeline" if pipe is not None else ""
    if not mode:
        raise ValueError(
            f"cannot shard {model_type}: mlx-lm has neither tensor parallelism nor pipeline "
            "stages for it; run it on one machine"
        )
    if mode == "tensor" and not tensor_ok:
        raise ValueError(f"cannot shard {model_type} by tensor parallelism; try --shard pipeline")
    if mode == "pipeline" and pipe is None:
        raise ValueError(f"mlx-lm has no pipeline stages for {model_type}; try --shard tensor")
    try:
        if mode == "pipeline":
            pipe.pipeline(group)
        elif has_shard:
            model.shard(group)
        else:
            _shard_dense(dense, group, model_type)
    except (AssertionError, ValueError) as exc:
        hint = "; try --shard pipeline" if mode == "tensor" and pipe is not None else ""
        raise ValueError(
            f"cannot shard {model_type} over {group.size()} ranks: {exc}{hint}"
        ) from exc
    return mode


def check_layers_local(model: nn.Module, layer_ids, what: str) -> None:
    """Refuse a drafter that reads inner target layers when the target is pipelined: each
    rank runs a stretch of layers only (the final hidden state is on every rank)."""
    sharding = sharding_of(model)
    if sharding is None or sharding.mode != "pipeline":
        return
    total = len(list(whole(model).layers))
    inner = sorted(i for i in layer_ids if i < total)
    if inner:
        raise ValueError(
            f"{what} reads the target's hidden states at layers {inner}, which a pipeline "
            f"spreads over the ranks; shard the target with --shard tensor (every rank sees "
            "every layer)"
        )


def check_drafter(model: nn.Module, drafter, layer_ids) -> None:
    """Refuse, on a sharded target, a drafter (or a member of a group) that attends over the
    target's own key/value cache (split across the ranks), or that reads `layer_ids` a
    pipeline stage does not run."""
    if sharding_of(model) is None:
        return
    for one in getattr(drafter, "drafters", [drafter]):
        if getattr(one, "reads_target_cache", False):
            raise ValueError(
                f"{one.name} attends over the target's own key/value cache, which a sharded "
                "target splits across the ranks: run it on one machine"
            )
    check_layers_local(model, layer_ids, drafter.name)


# --- agreement between ranks -----------------------------------------------------------------


def fingerprint(model_dir: Path, model: nn.Module, samples: int = 8, size: int = 1 << 16) -> bytes:
    """What every rank must have loaded alike: the config, the weight files' names and sizes,
    `samples` stretches of `size` bytes spread over each file (two fine-tunes of one model
    differ there; reading every byte of a large model would take minutes), and the names,
    shapes and dtypes of the parameters."""
    digest = hashlib.sha256()
    config = Path(model_dir) / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        length = path.stat().st_size
        digest.update(f"{path.name}:{length};".encode())
        with open(path, "rb") as f:
            for i in range(samples):
                f.seek(max(length - size, 0) * i // max(samples - 1, 1))
                digest.update(f.read(size))
    for name, value in tree_flatten(model.parameters()):
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
    return digest.digest()


def check_same(group: mx.distributed.Group, value: bytes, what: str) -> None:
    """Raise on every rank unless every rank passed the same `value`."""
    mine = mx.array(list(value[:16]), mx.int32)
    every = mx.distributed.all_gather(mine[None], group=group)
    mx.eval(every)
    rows = every.tolist()
    odd = [rank for rank, row in enumerate(rows) if row != rows[0]]
    if odd:
        raise ValueError(
            f"ranks {', '.join(map(str, odd))} loaded a different {what} than rank 0: every "
            "rank must load the same files"
        )


def barrier(group: mx.distributed.Group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


# --- shared decisions ------------------------------------------------------------------------


class Sync:
    """Shares rank 0's values with every rank of a sharded target's group."""

    def __init__(self, sharding: Sharding, ledger: CommLedger | None = None):
        self.group = sharding.group
        self.rank = sharding.rank
        self.size = sharding.size
        self.ledger = ledger
        # A pipeline stage receives its input with `recv_like`, which does not depend on the
        # tokens fed: a share feeding the pass must be done before the pass is built, else the
        # last stage could wait in its receive while the first waits in the share.
        self.eager_inputs = sharding.mode == "pipeline"

    def share(self, x: mx.array) -> mx.array:
        """Rank 0's integers `x` on every rank, lazily: an all-sum of `x` with `x * 0` on the
        other ranks. (Not zeros: the zeros would not depend on `x`, the other ranks' graphs
        would differ from rank 0's, and their collectives could run in another order.)

        A one-element all-sum over the ring backend takes milliseconds where a few elements
        take a tenth of that (measured on loopback after a pass's larger collectives), so
        short arrays are padded to `MIN_SHARED` elements (or one per rank, if more);
        `benchmarks/collectives.py` measures it."""
        mine = x.astype(mx.int32).reshape(-1)
        mine = mine if self.rank == 0 else mine * 0
        size, least = mine.size, max(MIN_SHARED, self.size)
        if size < least:
            mine = mx.concatenate([mine, mx.zeros((least - size,), mx.int32)])
        out = mx.distributed.all_sum(mine, group=self.group)
        return out[:size].reshape(x.shape).astype(x.dtype)

    def share_input(self, x: mx.array) -> mx.array:
        """`share(x)` for tokens that feed the target's next pass."""
        out = self.share(x)
        if self.eager_inputs:
            mx.eval(out)
        return out

    def share_ints(self, values: list[int]) -> list[int]:
        """Rank 0's integers on every rank, now (after `settle_streams`)."""
        settle_streams()
        out = self.share(mx.array(values, mx.int32))
        mx.eval(out)
        return out.tolist()

    def shared_seed(self, seed: int | None) -> int:
        """Rank 0's seed (drawn there when None), so every rank draws the same numbers."""
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        return self.share_ints([seed])[0]


def settle_streams() -> None:
    """Finish the work queued on the default stream and on mlx-lm's generation stream (its
    plain decoding runs there). A rank's collectives must run in the same order as every
    other rank's; two streams run side by side, so a pass still running on one while the next
    collective starts on the other would pair the ranks' messages up wrongly."""
    from mlx_lm.generate import generation_stream

    mx.synchronize()
    mx.synchronize(generation_stream)


def sync_for(model: nn.Module) -> Sync | None:
    """The `Sync` of a sharded target (one per model), or None for a target on one process."""
    sharding = sharding_of(model)
    if sharding is None:
        return None
    sync = getattr(model, "_mlx_spec_sync", None)
    if sync is None:
        sync = Sync(sharding, CommLedger.for_group(sharding.group))
        object.__setattr__(model, "_mlx_spec_sync", sync)
    return sync


# --- communication ledger --------------------------------------------------------------------

_COLLECTIVES = ("all_sum", "all_gather", "all_max", "all_min", "send", "recv", "recv_like")
_ACTIVE: list[CommLedger] = []
_ORIGINALS: dict[str, object] = {}


def _nbytes(args, kwargs) -> int:
    x = args[0] if args else kwargs.get("x")
    return int(getattr(x, "nbytes", 0) or 0)


def _install_counters() -> None:
    """Wrap the `mx.distributed` collectives so that the ledgers in use count each one built
    (the models look them up on the module at call time, so the wrappers see theirs)."""
    if _ORIGINALS:
        return
    for name in _COLLECTIVES:
        original = getattr(mx.distributed, name, None)
        if original is None:
            continue
        _ORIGINALS[name] = original

        def counted(*args, _original=original, **kwargs):
            if _ACTIVE:
                _ACTIVE[-1].record(_nbytes(args, kwargs))
            return _original(*args, **kwargs)

        setattr(mx.distributed, name, counted)


class CommLedger:
    """Collectives built while counting, priced by a start-up probe over the same group.

    The probe times chains of all-sums of a small and a large buffer on this group (the
    fastest of three chains each); a collective of n bytes is priced at latency + n / bandwidth
    from the two. The price is an estimate: a collective's time inside a pass overlaps with
    compute the probe does not see.
    """

    _BY_GROUP: dict[int, CommLedger] = {}

    def __init__(self, group: mx.distributed.Group, probe_rounds: int = 20):
        _install_counters()
        self.group = group
        self.latency, self.seconds_per_byte = self._probe(probe_rounds)
        self.collectives = 0
        self.bytes = 0

    @classmethod
    def for_group(cls, group: mx.distributed.Group) -> CommLedger:
        key = id(group)
        if key not in cls._BY_GROUP:
            cls._BY_GROUP[key] = cls(group)
        return cls._BY_GROUP[key]

    def _probe(self, rounds: int) -> tuple[float, float]:
        def chain(elements: int) -> float:
            x = mx.zeros((elements,), mx.float32)
            mx.eval(_ORIGINALS["all_sum"](x, group=self.group))  # warm the connection
            tic = time.perf_counter()
            for _ in range(rounds):
                x = _ORIGINALS["all_sum"](x, group=self.group) * 0.5
            mx.eval(x)
            return (time.perf_counter() - tic) / rounds

        small, large = MIN_SHARED, 1 << 16  # the least of 3 chains: the link, not the noise
        t_small = min(chain(small) for _ in range(3))
        t_large = min(chain(large) for _ in range(3))
        per_byte = max(t_large - t_small, 0.0) / ((large - small) * 4)
        return t_small, per_byte

    def record(self, nbytes: int) -> None:
        self.collectives += 1
        self.bytes += nbytes

    def price(self, collectives: int, nbytes: int) -> float:
        return collectives * self.latency + nbytes * self.seconds_per_byte

    @contextmanager
    def counting(self):
        """Count the collectives built inside the block: yields a function returning
        (collectives, bytes) so far."""
        start = (self.collectives, self.bytes)
        _ACTIVE.append(self)
        try:
            yield lambda: (self.collectives - start[0], self.bytes - start[1])
        finally:
            _ACTIVE.remove(self)


def share_bytes(sync: Sync, data: bytes | None) -> bytes:
    """Rank 0's `data` on every rank (the other ranks pass None): its length, then its bytes
    packed four to an int32 (two collectives; one when it is empty)."""
    (length,) = sync.share_ints([0 if data is None else len(data)])
    if length == 0:
        return b""
    words = (length + 3) // 4
    if sync.rank == 0:
        packed = np.frombuffer(data.ljust(words * 4, b"\0"), dtype=np.int32)
    else:
        packed = np.zeros(words, np.int32)
    out = sync.share(mx.array(packed))
    mx.eval(out)
    return np.array(out, dtype=np.int32).tobytes()[:length]


def shared_lines(group: mx.distributed.Group, lines):
    """Rank 0's input lines on every rank (the other ranks never read their own input)."""
    sync = Sync(Sharding(group, "lines"))
    source = iter(lines) if group.rank() == 0 else None
    while True:
        data = None
        if source is not None:
            line = next(source, None)
            data = b"\xff" if line is None else line.encode()
        data = share_bytes(sync, data)
        if data == b"\xff":
            return
        yield data.decode()


def agreed_bytes(group: mx.distributed.Group, nbytes: int, least: bool = False) -> int:
    """The largest (`least`: the smallest) of the ranks' byte counts, in whole KiB, the same
    on every rank.

    A rank holds its part of a sharded target's caches (pipeline stages: different parts), so
    its own count would evict or admit differently from the others'. Decisions taken on the
    agreed counts are taken alike everywhere: the fullest rank's bytes against the smallest
    rank's limit.
    """
    settle_streams()
    kib = -(-nbytes // 1024)
    width = max(MIN_SHARED, group.size())  # padded as `Sync.share` pads
    mine = mx.full((width,), -kib if least else kib, mx.int32)
    most = int(mx.distributed.all_max(mine, group=group)[0].item())
    return (-most if least else most) * 1024


class Lockstep:
    """Rank 0's engine turns, replayed on the other ranks.

    Rank 0 runs the server and decides each turn of its engine (the requests it admits, with
    everything needed to rebuild them; the ones whose clients left); `send` shares the turn,
    and the other ranks `receive` it and run the same turn, so every rank builds the same
    batches and passes in the same order. A turn with nothing new costs one collective.
    """

    def __init__(self, sharding: Sharding):
        self.sync = Sync(sharding)
        self.rank = sharding.rank

    def send(self, turn: dict) -> None:
        quiet = not any(turn.values())
        share_bytes(self.sync, b"" if quiet else json.dumps(turn).encode())

    def receive(self) -> dict:
        data = share_bytes(self.sync, None)
        return json.loads(data) if data else {}
