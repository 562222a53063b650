"""`specserve` on the command line: bad arguments are a usage error on stderr with exit status 2, never a
traceback (before any model loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.cli import main


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--max-tokens", "0"], "max_tokens: Input should be greater than or equal to 1"),
        (["--top-p", "2"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--device", "bogus"], "'bogus' is not a torch device"),
    ],
)
def test_bad_generate_arguments_are_usage_errors(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main(["generate", "hello", *args])
    except SystemExit as e:  # argparse's own usage errors
        status = int(e.code or 0)
    assert status == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA accepts --device cuda")
def test_a_cuda_device_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hello", "--device", "cuda"])
    assert exit_.value.code == 2 and "this torch has no CUDA device" in capsys.readouterr().err


def test_an_unreadable_gguf_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unreadable = tmp_path / "model.gguf"
    unreadable.symlink_to(Path("/proc/self/mem"))  # a regular file whose first bytes cannot be read (EIO)
    assert main(["models", "pull", str(unreadable)]) == 2
    err = capsys.readouterr().err
    assert "specserve: error: cannot read GGUF file" in err and "Traceback" not in err
