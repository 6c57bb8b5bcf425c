"""What `slicer-dispatch --early-start auto` asks for (`dispatcher.early.weight_bytes`): the
bytes of a revision's weight files, as vLLM would load them, read off sparse files."""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest

from gpu_slicer.dispatcher.early import weight_bytes
from gpu_slicer.dispatcher.startup import check_early_start

GIB = 1024**3


def sized(d: Path, name: str, n: int) -> None:
    with open(d / name, "wb") as f:
        os.truncate(f.fileno(), n)


def test_safetensors_are_counted_and_a_trainers_own_state_never(tmp_path: Path) -> None:
    sized(tmp_path, "model-00001-of-00002.safetensors", 10 * GIB)
    sized(tmp_path, "model-00002-of-00002.safetensors", 6 * GIB)
    sized(tmp_path, "pytorch_model.bin", 16 * GIB)  # the same weights again, the old format
    sized(tmp_path, "optimizer.pt", 64 * GIB)
    (tmp_path / "config.json").write_text("{}")
    assert weight_bytes(str(tmp_path)) == 16 * GIB


def test_without_safetensors_the_other_formats_count_but_trainer_state(tmp_path: Path) -> None:
    sized(tmp_path, "pytorch_model-00001-of-00002.bin", 3 * GIB)
    sized(tmp_path, "pytorch_model-00002-of-00002.bin", 2 * GIB)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        sized(tmp_path, name, GIB)
    assert weight_bytes(str(tmp_path)) == 5 * GIB


def test_nothing_to_count_is_zero(tmp_path: Path) -> None:
    (tmp_path / "revision.txt").write_text("r1")
    assert weight_bytes(str(tmp_path)) == 0
    assert weight_bytes(str(tmp_path / "missing")) == 0
    assert weight_bytes(str(tmp_path / "revision.txt")) == 0  # not a directory


@pytest.mark.parametrize(
    ("text", "value"),
    [("auto", None), ("off", 0), ("16GiB", 16 * GIB), ("0", 0), ("1024GiB", 1 << 40)],
)
def test_the_flag_takes_auto_off_or_a_size(text: str, value: int | None) -> None:
    assert check_early_start(None, None, text) == value  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["16GB", "-1", "lots", "1025GiB", ""])
def test_a_bad_flag_value_is_a_usage_error(text: str) -> None:
    with pytest.raises(click.BadParameter):
        check_early_start(None, None, text)  # type: ignore[arg-type]
