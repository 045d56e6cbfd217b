"""Which batches a chunk runs in when the run did not say: the device decides (issue 46).

On a GPU a token budget that tunes itself (``auto``); on the CPU ``--batch-size`` batches, measured
faster there; an image kind has no tokens; a batch size given alone means batches of that size."""

from __future__ import annotations

import pytest

from chunkq.jobs import kinds
from chunkq.jobs.compute.token_batches import for_device
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions, batch_tokens_value
from chunkq.supervisor.request import encode_options_of

GPU, CPU = "cuda", "cpu"


@pytest.mark.parametrize(
    ("asked", "device", "by_tokens", "runs"),
    [
        (None, GPU, True, "auto"),  # the GPU's default
        (None, CPU, True, None),  # the CPU's default: --batch-size batches
        ("auto", CPU, True, None),  # auto is a GPU setting
        ("auto", GPU, True, "auto"),
        ("off", GPU, True, None),  # the user asked for batches by count
        ("off", CPU, True, None),
        (4096, GPU, True, 4096),  # a number of tokens is kept on either
        (4096, CPU, True, 4096),
        (None, GPU, False, None),  # an image has no tokens
    ],
)
def test_the_device_chooses_batches_unless_the_run_said(
    asked: int | str | None, device: str, by_tokens: bool, runs: int | str | None
) -> None:
    assert for_device(EncodeOptions(batch_tokens=asked), device, by_tokens).batch_tokens == runs


def test_only_the_image_kind_has_no_tokens() -> None:
    assert [name for name, kind in kinds.KINDS.items() if not kind.by_tokens] == ["image"]


def test_a_batch_size_given_alone_means_batches_of_that_size_on_a_gpu_too() -> None:
    alone = encode_options_of({"batch_size": 64, "batch_tokens": None})
    assert (alone.batch_size, alone.batch_tokens) == (64, "off")
    assert for_device(alone, GPU).batch_tokens is None
    both = encode_options_of({"batch_size": 64, "batch_tokens": 2048})
    assert both.batch_tokens == 2048
    neither = encode_options_of({"batch_size": None, "batch_tokens": None})
    assert (neither.batch_size, neither.batch_tokens) == (EncodeOptions.batch_size, None)
    assert for_device(neither, GPU).batch_tokens == "auto"


def test_batch_tokens_takes_a_number_auto_or_off_and_nothing_else() -> None:
    assert [batch_tokens_value(v) for v in ("512", "auto", "off")] == [512, "auto", "off"]
    for bad in ("0", "on", "-5", "1.5"):
        with pytest.raises(ConfigError, match="'auto' or 'off'"):
            batch_tokens_value(bad)
    with pytest.raises(ConfigError, match="'auto' or 'off'"):
        EncodeOptions(batch_tokens="sometimes")


def test_an_image_run_may_say_off_but_not_a_budget() -> None:
    image = kinds.get("image")
    assert image.refuse(EncodeOptions(kind="image", batch_tokens="off")) is None
    assert "by count" in (image.refuse(EncodeOptions(kind="image", batch_tokens="auto")) or "")
