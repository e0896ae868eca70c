"""``vram doctor``: the checks before a sweep. The probe kit is imported only when it runs,
so the rest of ``vram`` never loads torch."""

from __future__ import annotations

import argparse

from .options import Command, add_json_option, dump_json


def add_doctor_options(p: argparse.ArgumentParser) -> None:
    add_json_option(p)


def doctor(args: argparse.Namespace) -> int:
    """Python, torch (build, CUDA/HIP), transformers, peft, bitsandbytes: versions and whether each
    imports; every visible GPU with its bus id, total and used memory and the processes holding it;
    CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER; a warning when memory is already held on a card.
    Works, and says so, on a machine without a GPU."""
    import contextlib
    import sys

    from probe_kit.doctor import diagnose, render

    with contextlib.redirect_stdout(sys.stderr):  # libraries print banners on import; stdout is ours
        report = diagnose()
    if args.json:
        dump_json(report)
    else:
        print(render(report))
    return 0


COMMANDS = [Command("doctor", "check versions and GPUs before a sweep", add_doctor_options, doctor)]
