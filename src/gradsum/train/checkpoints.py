"""What the launching process checks of a checkpoint before a resumed run starts any worker: it
exists, and it was made with the run's method (an aggregator's or codec's state does not carry
over to another's: THC's error feedback fed to PowerSGD, a switch's rounds resumed on a PS)."""

from __future__ import annotations

from pathlib import Path

# what train/loop.py saves beside the model: the method it trained with (methods.method_name)
METHOD_KEY = "method"
_WHAT_DIFFERS = (("aggregator", "aggregator"), ("codec", "codec"),
                 ("codec_options", "codec's options"), ("ddp_hook", "DDP hook"),
                 ("powersgd_rank", "PowerSGD rank"), ("shard", "sharding"),
                 ("local_steps", "local steps"))  # fmt: skip


def check_resume(config) -> None:
    """ValueError naming ``--resume`` when its checkpoint is missing, or was made with another
    method than ``config``'s, saying which part differs."""
    import torch

    from .methods import method_fields, method_name

    path = Path(config.resume)
    if not path.is_file():
        raise ValueError(f"--resume {config.resume}: no such checkpoint")
    saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get(METHOD_KEY)
    ours = method_name(config)
    if saved is None or saved == ours:
        return
    then, now = method_fields(saved), method_fields(ours)
    differs = [f"the {words} ({then.get(key) or 'none'}, not {now.get(key) or 'none'})"
               for key, words in _WHAT_DIFFERS if then.get(key) != now.get(key)]  # fmt: skip
    raise ValueError(
        f"--resume {config.resume}: the checkpoint was made with {saved}, this run is {ours}: "
        f"{' and '.join(differs)} differ{'s' if len(differs) == 1 else ''}"
    )


def epochs_done(path: str) -> int:
    """How many epochs the checkpoint at ``path`` holds (``--epochs`` counts them in all)."""
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=False, mmap=True)["epoch"]) + 1
