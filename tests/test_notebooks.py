"""Every notebook in notebooks/ runs headless from top to bottom on the embedded pair, and is
committed without outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
KERNEL = "mlx-spec-test"


def test_notebooks_exist_and_have_no_outputs():
    """Notebooks are committed stripped: no outputs, no execution counts."""
    import nbformat

    assert NOTEBOOKS
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory, worker_id):
    """A kernel spec for the running interpreter (found first through JUPYTER_PATH) and a
    fresh model cache shared by the notebooks, with the pair converted into it once (for all
    test workers: under a lock, in the run's shared temporary folder)."""
    from mlx_spec import embedded

    from filelock import FileLock
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(root / "kernels" / KERNEL)
    run_root = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # each xdist worker has a folder of its own inside the run's
        run_root = run_root.parent
    cache = run_root / "notebook-cache"
    with FileLock(f"{cache}.lock"), pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_SPEC_CACHE", str(cache))
        embedded.converted_pair()
    return {
        "JUPYTER_PATH": str(root),
        "MLX_SPEC_CACHE": str(cache),
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
    }


# Run first in the kernel: `bench.run_bench` checks the notebook's own settings, then measures
# every drafter they ask for at their shortest and longest draft lengths, on one short prompt,
# with the shortest generations those settings allow and one cost micro-benchmark pass per
# repeat. The cells, plots and tables see a report of the same shape; only the measuring is
# shorter.
SHORT_BENCH = """
from dataclasses import replace as _replace

from mlx_spec.bench import harness as _bench

_run_bench = _bench.run_bench


def _short_run_bench(config=None, progress=None):
    config = config or _bench.BenchConfig()
    config.validate()
    shortest = min(config.max_tokens, 2 * (max(config.num_draft) + 1))
    draft_lengths = sorted({min(config.num_draft), max(config.num_draft)})
    short = _replace(
        config,
        num_draft=tuple(draft_lengths),
        max_tokens=shortest,
        num_prompts=1,
        prompt_tokens=min(config.prompt_tokens, 32),
        micro_repeats=config.repeats,
    )
    return _run_bench(short, progress)


_bench.run_bench = _short_run_bench
"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_env, tmp_path, monkeypatch):
    """The notebook executes without an error (nbclient raises on the first failing cell), its
    benchmarks measured briefly (SHORT_BENCH)."""
    import nbformat
    from nbclient import NotebookClient

    for key, value in kernel_env.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(path, as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell(SHORT_BENCH))
    client = NotebookClient(
        notebook, timeout=600, kernel_name=KERNEL, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.output_type == "error"
    ]
    assert not errors
