"""The detokenizer's decoder (models/text_decoder.py) turns ids into exactly the text transformers'
tokenizer gives, for the test tokenizer and the packaged SmolLM2's, special tokens skipped or
kept; where transformers would clean up spaces it is transformers that decodes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from radixserve.models.source import resolve_model_source
from radixserve.models.text_decoder import TokenizersDecoder, fast_decoder, load_decoder
from radixserve.models.tokenizer import load_tokenizer


def assert_decodes_alike(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    tokenizer.save_pretrained(directory)
    decoder = load_decoder(str(directory))
    assert isinstance(decoder, TokenizersDecoder)
    reference = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    rng = random.Random(0)
    size = len(reference)
    special = list(reference.all_special_ids)
    for _ in range(300):
        ids = [rng.randrange(size) for _ in range(rng.randrange(1, 12))]
        if special and rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            ), ids


def test_the_test_tokenizer_decodes_alike(tiny_tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    assert_decodes_alike(tiny_tokenizer, tmp_path)


def test_smollm2_s_tokenizer_decodes_alike(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    assert_decodes_alike(load_tokenizer(resolve_model_source(str(smollm2_gguf_path))), tmp_path)


@pytest.mark.parametrize("missing", ["tokenizer.json", "cleanup"])
def test_falls_back_to_transformers_where_it_cannot_match(
    tiny_tokenizer: PreTrainedTokenizerFast, tmp_path: Path, missing: str
) -> None:
    tiny_tokenizer.save_pretrained(tmp_path)
    if missing == "tokenizer.json":
        (tmp_path / "tokenizer.json").unlink()
    else:
        # A non-BPE model that asks for the clean-up: transformers would change the text.
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        config["clean_up_tokenization_spaces"] = True
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        raw = json.loads((tmp_path / "tokenizer.json").read_text())
        if raw["model"]["type"] == "BPE":
            config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
            (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert fast_decoder(str(tmp_path)) is None
