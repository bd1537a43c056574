"""`--device` for the commands that run torch work (`gradsum train`, `gradsum bench codecs`,
`gradsum bench train` and `bench tta`)."""

from __future__ import annotations

DEVICE_NAMES = ("cuda", "cpu")


def resolve_device(asked: str | None) -> str:
    """cuda when present unless asked otherwise; cuda asked for without CUDA is a usage error."""
    import torch

    from .cli import UsageError

    if asked is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if asked == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda: no CUDA device is available here (torch.cuda.is_available() is "
            f"False, torch {torch.__version__}); use --device cpu"
        )
    return asked


def configured_device(args, sections, config):
    """``config`` with its device resolved: the command line's ``--device`` where given
    (``config.device`` is then its value), else cuda when present (``resolve_device``)."""
    from dataclasses import replace

    from .config import given

    asked = config.device if "device" in given(args, sections) else None
    return replace(config, device=resolve_device(asked))
