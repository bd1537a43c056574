"""`--device` for the commands that run torch work (`gradsum train`, `gradsum bench codecs`)."""

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
