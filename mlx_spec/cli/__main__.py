"""`python -m mlx_spec.cli`: the `mlx-spec` command."""

import sys

from mlx_spec.cli import main

sys.exit(main())
