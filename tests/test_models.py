"""The offline model builder and the sample data."""

from __future__ import annotations

import hashlib

from xeontune import models
from xeontune.cli import main


def test_tiny_pipeline_loads_with_diffusers_and_knows_its_words(tiny_model):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None)
    tok = pipe.tokenizer
    assert tok.model_max_length == 77
    for word in ("toy", "cat", "painting", "photo"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
    assert len(tok.encode("<toy-bot>", add_special_tokens=False)) > 1
    assert pipe.text_encoder.get_input_embeddings().weight.shape[0] == len(tok)
    assert pipe.text_encoder.config.eos_token_id == tok.eos_token_id


def test_sd15_vocabulary_has_clips_size():
    vocab, merges = models.tokenizer_files(models._template_words(), 49408)
    assert len(vocab) == 49408 and sorted(vocab.values()) == list(range(49408))
    assert vocab["<|endoftext|>"] == 49407 and merges


def test_sample_data_is_deterministic(tmp_path):
    a = models.write_sample_data(tmp_path / "a", count=3, size=64, seed=1)
    b = models.write_sample_data(tmp_path / "b", count=3, size=64, seed=1)
    c = models.write_sample_data(tmp_path / "c", count=3, size=64, seed=2)

    def digest(files):
        return [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]

    assert digest(a) == digest(b) != digest(c)
    assert len(set(digest(a))) == 3  # varied poses and backgrounds


def test_cli_bad_model_kind_and_count(capsys, tmp_path):
    assert main(["sample-data", str(tmp_path / "x"), "--count", "0"]) == 2
    assert "--count must be at least 1" in capsys.readouterr().err
