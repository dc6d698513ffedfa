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
def kernel_env(tmp_path_factory):
    """A kernel spec for the running interpreter (found first through JUPYTER_PATH) and a
    fresh model cache shared by the notebooks (the pair is converted once)."""
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(root / "kernels" / KERNEL)
    return {
        "JUPYTER_PATH": str(root),
        "MLX_SPEC_CACHE": str(tmp_path_factory.mktemp("cache")),
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
    }


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_env, tmp_path, monkeypatch):
    """The notebook executes without an error (nbclient raises on the first failing cell)."""
    import nbformat
    from nbclient import NotebookClient

    for key, value in kernel_env.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(path, as_version=4)
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
