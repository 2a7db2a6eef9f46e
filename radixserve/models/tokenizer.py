"""Tokenizer loading: a checkpoint directory's as it is; a GGUF's converted once and kept."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.config.server_args import InvalidArgumentError
from radixserve.models.config import ModelLoadError
from radixserve.models.heap import release_freed_heap
from radixserve.models.source import ModelSource, gguf_metadata
from radixserve.paths import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("radixserve")

# The class names a saved fast tokenizer's config gives (transformers 5 and 4): such a directory
# needs nothing of the model's config to load.
_FAST_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# GGUF architectures radixserve serves whose model config transformers' GGUF import does not read.
_GGUF_ARCHS_TRANSFORMERS_LACKS = frozenset({"olmoe"})


def load_tokenizer_dir(path: str | Path) -> PreTrainedTokenizerBase:
    """A tokenizer directory, from local files only, loaded as AutoTokenizer loads it. One whose
    config names the fast tokenizer class itself is loaded through that class: AutoTokenizer's
    lookup imports transformers' model registry and torch with it, seconds of every start in a
    process (the HTTP server's) that otherwise never needs torch."""
    config = Path(path) / "tokenizer_config.json"
    try:
        named = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None  # AutoTokenizer reports what is missing or wrong
    if named in _FAST_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        tokenizer_class: Any = PreTrainedTokenizerFast
    else:
        from transformers import AutoTokenizer

        tokenizer_class = AutoTokenizer
    tokenizer: PreTrainedTokenizerBase = tokenizer_class.from_pretrained(str(path), local_files_only=True)
    release_freed_heap()  # the parse of tokenizer.json: transient, and larger than the tokenizer
    return tokenizer


def load_tokenizer(src: ModelSource) -> PreTrainedTokenizerBase:
    """Load the checkpoint's tokenizer from local files only, chat template included. A GGUF's is
    converted once and kept (tokenizer_cache_dir): the conversion reads the whole vocabulary
    from the file's metadata and takes seconds at every start, the saved copy a fraction of one."""
    try:
        if src.kind == "hf_dir":
            return load_tokenizer_dir(src.path)
        saved = _saved_tokenizer_dir(src.path)
        if (saved / "tokenizer_config.json").exists():
            try:
                return load_tokenizer_dir(saved)
            except (OSError, ValueError) as exc:
                logger.warning("replacing the unusable saved tokenizer at %s (%s)", saved, exc)
                shutil.rmtree(saved, ignore_errors=True)
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        # AutoTokenizer reads the file's model config first, which transformers cannot for some
        # architectures; the fast tokenizer itself comes from the tokenizer.ggml.* fields alone.
        by_fields_only = gguf_metadata(src.path, "general.architecture") in _GGUF_ARCHS_TRANSFORMERS_LACKS
        tokenizer = (PreTrainedTokenizerFast if by_fields_only else AutoTokenizer).from_pretrained(
            str(src.path.parent), gguf_file=src.path.name, local_files_only=True
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Could not load tokenizer from {src.path}: {exc}") from exc

    if not getattr(tokenizer, "chat_template", None):
        template = gguf_metadata(src.path, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    _save_tokenizer(tokenizer, saved)
    release_freed_heap()
    return tokenizer


def tokenizer_cache_dir() -> Path:
    return cache_dir("tokenizers", "RADIXSERVE_TOKENIZER_CACHE")


def _saved_tokenizer_dir(gguf: Path) -> Path:
    """The converted tokenizer's place: keyed by the file (path, size, modification time) and the
    transformers version that converted it, so a changed file or converter converts again."""
    import transformers

    stat = gguf.stat()
    parts = [str(gguf.resolve()), str(stat.st_size), str(stat.st_mtime_ns), transformers.__version__]
    parts.append(_SAVED_CLASS)
    return tokenizer_cache_dir() / hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# The class a converted GGUF tokenizer is saved under when it is a fast one: its tokenizer.json holds
# the whole pipeline, and the model's own class (GemmaTokenizer, ...) adds nothing to it but a second
# copy of the vocabulary in Python (Gemma 3's 262k tokens: ~540 MB a process against ~320 MB).
_SAVED_CLASS = "PreTrainedTokenizerFast"


def _name_saved_class(config: Path) -> None:
    fields = json.loads(config.read_text(encoding="utf-8"))
    fields["tokenizer_class"] = _SAVED_CLASS
    config.write_text(json.dumps(fields, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Saved beside the target, then renamed: a process loading at the same time never reads a
    partial copy. A cache that cannot be written only costs the next start the conversion."""
    scratch = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=target.parent, prefix=".partial-")
        tokenizer.save_pretrained(scratch)
        if tokenizer.is_fast:
            _name_saved_class(Path(scratch) / "tokenizer_config.json")
        os.replace(scratch, target)
        scratch = None
    except OSError as exc:
        logger.info("the converted tokenizer was not saved (%s); the next start converts it again", exc)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _is_file(value: str) -> bool:
    try:
        return Path(value).is_file()
    except OSError:
        return False  # an inline template longer than a file name may be


def set_chat_template(tokenizer: PreTrainedTokenizerBase, value: str) -> None:
    """--chat-template: a Jinja file, or the template itself inline (vLLM's and SGLang's flag); it
    replaces the model's own. Checked here, at startup: a value that is neither, or a template
    Jinja cannot parse, is refused with the reason."""
    import jinja2

    if _is_file(value):
        template = Path(value).read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise InvalidArgumentError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidArgumentError(f"--chat-template does not parse as Jinja: {exc}") from exc
    tokenizer.chat_template = template
