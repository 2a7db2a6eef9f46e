"""The hierarchical cache flags (SGLang's names): defaults, the command line, and what is refused."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from radixserve.config.hicache_args import STORAGE_DIR_ENV, storage_dir
from radixserve.config.server_args import InvalidArgumentError, ServerArgs


def _args(**fields: object) -> ServerArgs:
    args = ServerArgs(model_path="m", **fields)  # type: ignore[arg-type]
    args.validate()
    return args


def test_the_command_line_takes_sglang_s_flags() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        ["--model-path", "m", "--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
         "--hicache-storage-backend", "file", "--hicache-storage-dir", "/tmp/x", "--hicache-ratio", "3",
         "--hicache-storage-size-gb", "2", "--page-size", "4"]
    )  # fmt: skip
    args = ServerArgs.from_cli_args(ns)
    args.validate()
    assert (args.enable_hierarchical_cache, args.hicache_write_policy, args.hicache_storage_backend) == (
        True, "write_back", "file",
    )  # fmt: skip
    # The storage page defaults to 64 tokens, a whole number of device pages.
    assert args.hicache_storage_page_size == 64 and args.hicache_ratio == 3.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hicache_storage_backend": "file"}, "needs --enable-hierarchical-cache"),
        ({"enable_hierarchical_cache": True, "disable_radix_cache": True}, "needs the radix cache"),
        ({"enable_hierarchical_cache": True, "hicache_write_policy": "sometimes"}, "write-policy"),
        ({"enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}, "not available"),
        ({"enable_hierarchical_cache": True, "page_size": 4, "hicache_storage_page_size": 6}, "multiple"),
        ({"enable_hierarchical_cache": True, "hicache_storage_size_gb": 0}, "size-gb"),
    ],
)
def test_what_cannot_work_is_refused_at_startup(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        _args(**fields)


def test_the_storage_directory_is_the_flag_then_sglang_s_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STORAGE_DIR_ENV, str(tmp_path / "env"))
    assert storage_dir(_args(enable_hierarchical_cache=True)) == tmp_path / "env"
    flagged = _args(enable_hierarchical_cache=True, hicache_storage_dir=str(tmp_path / "flag"))
    assert storage_dir(flagged) == tmp_path / "flag"
    monkeypatch.delenv(STORAGE_DIR_ENV)
    assert storage_dir(_args(enable_hierarchical_cache=True)).parts[-2:] == ("radixserve", "hicache")
