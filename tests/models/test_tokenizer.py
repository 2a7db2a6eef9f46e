"""Tokenizer loading: the packaged SmolLM2 GGUF's (converted once, then kept) and a directory's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from radixserve.config.server_args import InvalidArgumentError
from radixserve.models.source import ModelSource, load_model_config
from radixserve.models.tokenizer import (
    load_tokenizer,
    load_tokenizer_dir,
    set_chat_template,
    tokenizer_cache_dir,
)

# Reference ids from transformers' GGUF tokenizer for SmolLM2 (identical to the HF repo's).
SMOLLM2_FRANCE_IDS = [504, 3575, 282, 4649, 314]


@pytest.fixture(scope="module")
def gguf_src(smollm2_gguf_path: Path) -> ModelSource:
    return ModelSource("gguf", smollm2_gguf_path)


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_src: ModelSource) -> Any:
    return load_tokenizer(gguf_src)


def test_gguf_tokenizer(gguf_tokenizer: Any, gguf_src: ModelSource) -> None:
    tok = gguf_tokenizer
    cfg = load_model_config(gguf_src)
    assert len(tok) == cfg.vocab_size
    assert tok("The capital of France is").input_ids == SMOLLM2_FRANCE_IDS
    assert tok.decode(SMOLLM2_FRANCE_IDS) == "The capital of France is"
    assert tok.eos_token_id in cfg.eos_token_ids
    assert tok.convert_ids_to_tokens(cfg.eos_token_ids[0]) == "<|im_end|>"
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_gguf_chat_template_filled_from_metadata(
    gguf_src: ModelSource,
    tiny_tokenizer: PreTrainedTokenizerFast,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import transformers

    # An empty cache of its own: the conversion runs, and this stand-in is saved nowhere else.
    monkeypatch.setenv("RADIXSERVE_TOKENIZER_CACHE", str(tmp_path))
    bare = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    assert not bare.chat_template
    calls: list[dict[str, Any]] = []

    def fake_from_pretrained(path: str, **kwargs: Any) -> PreTrainedTokenizerFast:
        calls.append({"path": path, **kwargs})
        return bare

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake_from_pretrained)
    tok = load_tokenizer(gguf_src)
    assert calls == [
        {"path": str(gguf_src.path.parent), "gguf_file": gguf_src.path.name, "local_files_only": True}
    ]
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_hf_dir_tokenizer(
    tiny_model_dir: Callable[[str], Path], tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    tok = load_tokenizer(ModelSource("hf_dir", tiny_model_dir("qwen3")))
    text = "def f(x):\n    return x + 1"
    assert tok(text).input_ids == tiny_tokenizer(text).input_ids
    assert tok.chat_template == tiny_tokenizer.chat_template
    assert tok.eos_token == "<|endoftext|>"


@pytest.fixture(scope="module")
def converted(gguf_src: ModelSource) -> Any:
    """transformers' own conversion of the GGUF's tokenizer (done once here: it takes seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(gguf_src.path.parent), gguf_file=gguf_src.path.name, local_files_only=True
    )


def _convert_by_fixture(monkeypatch: pytest.MonkeyPatch, converted: Any) -> list[str]:
    """Routes load_tokenizer's GGUF conversion to the fixture's result and counts the calls
    ("gguf": a conversion, "saved": a load of the saved copy, which stays real)."""
    import transformers

    calls: list[str] = []
    real_auto = transformers.AutoTokenizer.from_pretrained
    real_fast = transformers.PreTrainedTokenizerFast.from_pretrained

    def routed(path: str, **kwargs: Any) -> Any:
        calls.append("gguf" if "gguf_file" in kwargs else "saved")
        return converted if "gguf_file" in kwargs else real_auto(path, **kwargs)

    def saved(path: str, **kwargs: Any) -> Any:
        calls.append("saved")
        return real_fast(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", routed)
    # The saved copy names the fast class, so load_tokenizer_dir loads it through that class.
    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", saved)
    return calls


def test_a_gguf_tokenizer_is_converted_once_and_then_loaded_as_saved(
    gguf_src: ModelSource, converted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    assert tokenizer_cache_dir() == tmp_path / "tokenizers"
    calls = _convert_by_fixture(monkeypatch, converted)
    first = load_tokenizer(gguf_src)
    second = load_tokenizer(gguf_src)
    assert calls == ["gguf", "saved"]
    assert [p.name for p in (tmp_path / "tokenizers").iterdir() if p.name.startswith(".")] == []
    # Saved under the fast class whatever the converted one's: nothing but tokenizer.json to load.
    from transformers import PreTrainedTokenizerFast

    assert type(second) is PreTrainedTokenizerFast
    chat = [{"role": "user", "content": "Hi"}]
    assert second("The capital of France is").input_ids == SMOLLM2_FRANCE_IDS
    assert second.get_vocab() == first.get_vocab()
    assert second.eos_token_id == first.eos_token_id and second.bos_token_id == first.bos_token_id
    assert second.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        first.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )


def test_an_unusable_tokenizer_cache_only_costs_the_conversion(
    gguf_src: ModelSource, converted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _convert_by_fixture(monkeypatch, converted)
    # A file where the cache directory should be: nothing can be saved, and loading still works.
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setenv("RADIXSERVE_TOKENIZER_CACHE", str(blocked / "tokenizers"))
    assert load_tokenizer(gguf_src) is converted
    assert load_tokenizer(gguf_src) is converted
    assert calls == ["gguf", "gguf"]
    # A corrupt saved copy is ignored, converted again and replaced.
    monkeypatch.setenv("RADIXSERVE_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    load_tokenizer(gguf_src)
    (saved,) = (tmp_path / "tokenizers").iterdir()
    (saved / "tokenizer.json").write_text("{not json")
    calls.clear()
    assert load_tokenizer(gguf_src) is converted
    assert calls == ["saved", "gguf"]
    assert load_tokenizer(gguf_src)("The capital of France is").input_ids == SMOLLM2_FRANCE_IDS
    assert calls == ["saved", "gguf", "saved"]


def _same_tokenizer(ours: Any, auto: Any) -> None:
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    text = "def f(x):\n    return x + 1 <|endoftext|> The capital of France is"
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.pad_token_id,
    )  # fmt: skip
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.decode(auto(text).input_ids, skip_special_tokens=True) == auto.decode(
        auto(text).input_ids, skip_special_tokens=True
    )
    assert ours.chat_template == auto.chat_template
    if auto.chat_template:
        rendered = ours.apply_chat_template(chat, tokenize=False)
        assert rendered == auto.apply_chat_template(chat, tokenize=False)


def test_a_saved_fast_tokenizer_loads_as_autotokenizer_loads_it(
    gguf_tokenizer: Any, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """load_tokenizer_dir loads a directory that names the fast class through that class (no
    AutoTokenizer, whose lookup imports torch): the same tokenizer, for the SmolLM2 GGUF's saved
    conversion and for a checkpoint's own files."""
    from transformers import AutoTokenizer

    gguf_tokenizer.save_pretrained(tmp_path / "smollm2")
    for path in (tmp_path / "smollm2", tiny_model_dir("llama")):
        auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        _same_tokenizer(load_tokenizer_dir(path), auto)


def test_a_tokenizer_of_another_class_still_loads_through_autotokenizer(minilm_path: Path) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer_dir(minilm_path)
    assert type(ours).__name__.startswith("Bert")
    _same_tokenizer(ours, AutoTokenizer.from_pretrained(str(minilm_path), local_files_only=True))


def test_a_chat_template_value_is_a_file_or_jinja(tmp_path: Path) -> None:
    """--chat-template's check at startup (the template's effect: tests/server/test_chat_template_flag.py)."""
    tokenizer = SimpleNamespace(chat_template=None)
    with pytest.raises(InvalidArgumentError, match="neither a file nor a Jinja template"):
        set_chat_template(tokenizer, "chatml")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="does not parse as Jinja"):
        set_chat_template(tokenizer, "{% for m in messages %}")  # type: ignore[arg-type]
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    set_chat_template(tokenizer, str(path))  # type: ignore[arg-type]
    assert tokenizer.chat_template == "{{ messages[0]['content'] }}"  # type: ignore[attr-defined]
