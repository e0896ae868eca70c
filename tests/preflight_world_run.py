"""A run on two CPU processes (``torchrun --nproc_per_node 2``, gloo) with preflight: each rank
writes what preflight concluded to OUT/rank-K.json (tests/test_preflight.py runs it).

    python -m torch.distributed.run --nproc_per_node 2 tests/preflight_world_run.py OUT BUDGET_MIB RANK0_EXTRA
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from probe_kit.preflight import Preflight, PreflightFailed  # noqa: E402
from test_preflight import collate, examples, tiny_model  # noqa: E402


def main() -> None:
    out, budget, extra = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    model = tiny_model(dropout=0.0)
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                             max_steps=2, use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
                             logging_strategy="no", seed=3, gradient_checkpointing=True, remove_unused_columns=False,
                             disable_tqdm=True)
    # Rank 0's examples are longer by ``extra`` tokens: its worst batch, and its step, are the larger.
    data = examples(longest=120 + (extra if rank == 0 else 0))
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    pre = Preflight(trainer, budget_mib=budget)
    trainer.add_callback(pre)
    doc = {"rank": rank, "world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1}
    try:
        trainer.train()
        doc["trained"] = True
        r = pre.result
    except PreflightFailed as exc:
        doc["trained"] = False
        r = exc.result
    doc.update(verdict=r.verdict if r else None, world_seen=r.world if r else None, strategy=r.strategy if r else None,
               rank_peaks=r.rank_peaks_mib if r else None, peak=r.step.peak_allocated_mib if r else None,
               alternative=r.alternative.changes if r and r.alternative else None)
    (out / f"rank-{rank}.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
