"""mlx-spec: lossless speculative decoding on MLX."""

from mlx_spec.platform import blas as _blas

_blas.preload()  # must precede the first `import mlx.core` (see platform/blas.py)

from mlx_spec.platform import heap  # noqa: E402

heap.install()  # Linux: malloc keeps freed memory for the next pass's buffers

from mlx_spec.models import reference_fixes  # noqa: E402

reference_fixes.install()  # where mlx-lm's model of a family differs from the reference

from mlx_spec.platform import fastmath  # noqa: E402

fastmath.install()  # MLX's Linux CPU exp is scalar: SwiGLU and attention get a vectorized one

from mlx_spec.platform import fused  # noqa: E402

fused.install()  # MLX's CPU RoPE and RMSNorm are graphs of small ops: fewer, fused ones

from mlx_spec.platform import short_attention  # noqa: E402

short_attention.install()  # CUDA builds a kernel per shape of a multi-query attention

from mlx_spec.api import GenerationChunk, GenerationResult, generate, stream_generate  # noqa: E402
from mlx_spec.core.sampling import SamplingConfig  # noqa: E402
from mlx_spec.core.stats import SpecStats  # noqa: E402
from mlx_spec.core.version import VERSION as __version__  # noqa: E402
from mlx_spec.drafters.base import Draft, Drafter  # noqa: E402
from mlx_spec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from mlx_spec.drafters.gemma4_assistant import load_gemma4_assistant  # noqa: E402
from mlx_spec.drafters.ngram import NgramDrafter  # noqa: E402
from mlx_spec.loading import (  # noqa: E402
    load,
    load_branching_drafter,
    load_branching_mtp,
    load_dflash_drafter,
    load_drafter,
    load_eagle3_drafter,
    load_eagle3_tree,
    load_medusa_drafter,
    load_mtp_drafter,
)
from mlx_spec.serving.session import Session  # noqa: E402

__all__ = [
    "__version__",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "GenerationChunk",
    "GenerationResult",
    "NgramDrafter",
    "SamplingConfig",
    "Session",
    "SpecStats",
    "generate",
    "load",
    "load_branching_drafter",
    "load_branching_mtp",
    "load_dflash_drafter",
    "load_eagle3_drafter",
    "load_eagle3_tree",
    "load_drafter",
    "load_gemma4_assistant",
    "load_medusa_drafter",
    "load_mtp_drafter",
    "stream_generate",
]
