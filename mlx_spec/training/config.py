"""The settings of one distillation run."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("draft-model", "mtp", "medusa", "eagle3", "dflash")


@dataclass(frozen=True)
class DistillConfig:
    """Settings of one distillation run (recorded in the checkpoint and the output)."""

    kind: str = "draft-model"
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 1e-3
    checkpoint_every: int = 50
    seed: int = 0
    hidden_size: int = 128  # draft model only
    num_layers: int = 2  # draft model and DFlash
    mtp_family: str = "mimo"  # MTP only: the published layout to store it in
    heads: int = 3  # Medusa only: heads (each guesses one position further)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "checkpoint_every",
            "hidden_size",
            "num_layers",
            "heads",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
