"""vram ledger: a ledger of measured GPU memory for LLM (Q)LoRA fine-tuning.

``ledger`` is the only package that reads or writes ledger files; it never imports torch.
"""

from .models import SCHEMA_VERSION, Ledger, Measurement

__all__ = ["SCHEMA_VERSION", "Ledger", "Measurement"]
