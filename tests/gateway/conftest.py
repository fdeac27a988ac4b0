"""Fixtures shared by the gateway tests: the tiny model's tokenizer, ours and transformers'."""

import pytest

from m3stack.gateway.tokenize.tokenizer import ModelTokenizer


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir) -> ModelTokenizer:
    return ModelTokenizer.from_folder(tiny_model_dir)
