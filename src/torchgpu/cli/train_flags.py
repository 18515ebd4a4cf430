"""The ``N|auto`` flags of ``torchgpu train`` as argparse ``type=`` functions."""

from __future__ import annotations

import argparse


def _int_or_auto(text: str, flag: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(  # argparse prints it and exits 2
            f"{text!r} is not an integer or auto (e.g. {flag} 4 or {flag} auto)"
        ) from None


def parse_chunks(text: str) -> int | str:
    """``--chunks`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--chunks")


def parse_batch_size(text: str) -> int | str:
    """``--batch-size`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--batch-size")


def parse_num_workers(text: str) -> int | str:
    """``--num-workers`` value: an integer or ``auto`` (argparse ``type=``)."""
    return _int_or_auto(text, "--num-workers")
