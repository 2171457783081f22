"""The decoder tests' tokenizer, text and compile cache, made once for the folder's files."""

import os
from pathlib import Path

import pytest
from extract_helpers import write_text_dataset


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """One persistent XLA cache for the decoder's runs, in-process and subprocesses alike: the same train
    step, compiled once (~30 s on a busy 2-core machine), is reused by every run of the same shapes."""
    import jax

    cache = tmp_path_factory.getbasetemp() / "decoder-xla-cache"
    cache.mkdir(exist_ok=True)
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(cache))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    yield
    os.environ.pop("JAX_COMPILATION_CACHE_DIR")
    jax.config.update("jax_compilation_cache_dir", before)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The demo's byte-level tokenizer (259 tokens), with its tiny checkpoint."""
    from harvest.demo import demo_checkpoint

    return demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def text_data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("text") / "text.jsonl", n=120)
