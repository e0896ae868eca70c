"""A real run's allocator history replayed through the caching allocator's model
(``probe_kit.allocator``), against what the real allocator reserved: the model checked on your own
card, with your own run.

    import torch
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    ...  # the run, or its first steps
    torch.cuda.memory._dump_snapshot("run.pickle")

    python -m probe_kit.replay run.pickle [--alloc-conf expandable_segments:True]

The snapshot is a pickle: open only your own.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from typing import Optional

from .allocator import MIB, AllocConf, AllocConfError, replay, trace_of_snapshot


def main(argv: Optional[list[str]] = None) -> int:
    """Replay the snapshot's history; print the real and the replayed peak reserved."""
    p = argparse.ArgumentParser(
        prog="python -m probe_kit.replay",
        description="Replay a real run's allocator history (torch.cuda.memory._record_memory_history, then "
                    "torch.cuda.memory._dump_snapshot(FILE)) through this model of the caching allocator and "
                    "compare its peak reserved with the real one. The snapshot is a pickle: open only your own.",
        epilog="Exit codes: 0 ok, 1 bad input, 2 bad usage.")
    p.add_argument("snapshot", help="the pickle torch.cuda.memory._dump_snapshot wrote")
    p.add_argument("--device", type=int, default=0, help="the device whose history to replay (default 0)")
    p.add_argument("--alloc-conf", default="", help="the PYTORCH_CUDA_ALLOC_CONF the run had (default: none)")
    args = p.parse_args(argv)
    try:
        conf = AllocConf.parse(args.alloc_conf)
    except AllocConfError as exc:
        print(f"--alloc-conf: {exc}", file=sys.stderr)
        return 1
    try:
        with open(args.snapshot, "rb") as fh:
            snap = pickle.load(fh)
        events = snap["device_traces"][args.device]
    except FileNotFoundError:
        print(f"{args.snapshot}: no such file", file=sys.stderr)
        return 1
    except (pickle.UnpicklingError, EOFError, KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        print(f"{args.snapshot}: not a memory snapshot with device {args.device}'s history "
              f"({type(exc).__name__})", file=sys.stderr)
        return 1
    trace, real = trace_of_snapshot(events)
    if not real["allocations"]:
        print(f"{args.snapshot}: device {args.device}'s history has no allocation (was "
              "torch.cuda.memory._record_memory_history called before the run?)", file=sys.stderr)
        return 1
    sim = replay(trace, conf)
    err = (sim.peak_reserved - real["peak_reserved"]) / real["peak_reserved"] * 100 if real["peak_reserved"] else None
    print(f"{real['events']} events, {real['allocations']} allocations ({real['unmatched_frees']} frees of blocks "
          f"made before the history began, left out)")
    print(f"real peak reserved {real['peak_reserved'] / MIB:,.1f} MiB (its segment events); replayed "
          f"{sim.peak_reserved / MIB:,.1f} MiB" + (f" ({err:+.2f}%)" if err is not None else "")
          + f"; replayed peak allocated {sim.peak_allocated / MIB:,.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
