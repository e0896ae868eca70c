"""The optimizer's state: what each optimizer a user names by its ``TrainingArguments`` name keeps
across steps for the adapter's trainable tensors, in bytes, as the CUDA caching allocator holds it
(each tensor a block rounded up to 512 bytes). No torch: layouts written from each library's code
and checked against the state the optimizer really allocates after its first step on CPU tensors
(``tests/test_optimizers.py``, within 0.5% for every name here).

- ``adamw_torch``: ``torch.optim.AdamW`` (foreach): ``exp_avg`` and ``exp_avg_sq`` like the
  parameter (fp32 for a LoRA adapter); its ``step`` counters live on the host.
- ``adamw_torch_fused``: the same, with each ``step`` counter a one-element fp32 tensor on the card.
- ``adamw_8bit``: bitsandbytes ``AdamW8bit``: a tensor of at least 4,096 elements keeps two uint8
  states and two fp32 absmax vectors (one per block of 256), plus the two shared 256-entry quantile
  maps once; a smaller tensor keeps two fp32 states.
- ``paged_adamw_8bit`` / ``paged_adamw_32bit``: bitsandbytes' paged optimizers keep the states of a
  tensor of at least 100,000 elements in CUDA unified (managed) memory, which
  ``torch.cuda.max_memory_allocated`` does not count: it does not raise the allocator's peak, but it
  is device memory the driver pages to host RAM under pressure (slower steps, and it still takes
  room on the card while resident). Counted apart as ``paged``.
- ``adafactor``: transformers' ``Adafactor`` as the Trainer builds it (no first moment): a matrix
  keeps a row and a column second-moment vector, a vector one of its own size, and each tensor its
  RMS as a one-element tensor.
- ``sgd``: ``torch.optim.SGD`` as the Trainer builds it (momentum 0): no state.

The step itself holds more for a moment (``transient``): on a GPU torch's AdamW steps every tensor
at once (foreach), and its ``_foreach_sqrt`` of the second moment is a temporary the size of every
parameter together; the fused AdamW, SGD without momentum and bitsandbytes' kernels work in place;
Adafactor steps one tensor at a time, with two temporaries the size of that tensor. A training
run's peak is at least what the step holds: the weights, the adapter, its gradients, the state and
this transient (``tests/test_optimizers.py`` checks it on the real step of tiny configs).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from math import prod
from typing import Iterable, Mapping, Optional, Union

BLOCK = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
BNB_MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep 32-bit state
BNB_BLOCK = 256  # elements per absmax block of bitsandbytes' blockwise 8-bit state
BNB_PAGED_MIN = 100_000  # bitsandbytes pages a state buffer only from this many elements

#: What a stock ``transformers`` Trainer steps unless told otherwise: AdamW with fp32 moments.
STOCK_OPTIMIZER = "adamw_torch"
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit",
              "adafactor", "sgd")


def optimizer_for(fixes: str, asked: Optional[str] = None) -> Optional[str]:
    """The optimizer a training run of a recipe steps: the one asked; unset, a stock recipe (any
    fixes but the program's full set, ``all``) steps ``STOCK_OPTIMIZER``, whose state the run adds,
    and the program's preset counts none beyond what its measured runs hold."""
    return asked or (None if fixes == "all" else STOCK_OPTIMIZER)


def _block(nbytes: int) -> int:
    return (nbytes + BLOCK - 1) // BLOCK * BLOCK


def transient_bytes(name: str, shapes: Union[Iterable[tuple[int, ...]], Mapping[tuple[int, ...], int]],
                    param_bytes: int = 4) -> int:
    """Bytes the optimizer's step holds for a moment beyond its state (see the module's text), as
    torch steps on a GPU. Raises ValueError for an optimizer this module does not know."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})")
    counts = shapes if isinstance(shapes, Mapping) else Counter(tuple(s) for s in shapes)
    if name == "adamw_torch":
        return sum(k * _block(prod(shape) * param_bytes) for shape, k in counts.items())
    if name == "adafactor":
        return 2 * max((_block(prod(shape) * param_bytes) for shape in counts), default=0)
    return 0


@dataclass(frozen=True)
class OptimizerState:
    """Bytes of state an optimizer keeps for some tensors: in the allocator (``device``: raises
    peak allocated), and in unified memory (``paged``: on the card while resident, not counted by
    the allocator)."""

    name: str
    device: int
    paged: int
    tensors: int  # how many trainable tensors it was computed for

    @property
    def device_mib(self) -> float:
        return self.device / 2**20

    @property
    def paged_mib(self) -> float:
        return self.paged / 2**20

    def describe(self) -> str:
        text = f"{self.name}: {self.device_mib:,.1f} MiB of state on the card"
        if self.paged:
            text += (f" and {self.paged_mib:,.1f} MiB in unified memory (paged: not in the allocator's peak; "
                     "the driver moves it to host RAM under pressure)")
        return text


def state_bytes(name: str, shapes: Union[Iterable[tuple[int, ...]], Mapping[tuple[int, ...], int]],
                param_bytes: int = 4) -> OptimizerState:
    """The state ``name`` keeps for trainable tensors of these shapes, or of a mapping shape -> how
    many tensors have it (``param_bytes`` each element:
    4 for the fp32 adapter peft makes). Raises ValueError for an optimizer this module does not know."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})")
    device = paged = 0
    # peft's adapter repeats a few shapes per layer: a mapping shape -> count is taken as it is
    counts = shapes if isinstance(shapes, Mapping) else Counter(tuple(s) for s in shapes)
    eight_bit = False
    for shape, k in counts.items():
        n = prod(shape)
        if name in ("adamw_torch", "adamw_torch_fused"):
            device += k * (2 * _block(n * param_bytes) + (_block(4) if name == "adamw_torch_fused" else 0))
        elif name in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"):
            if name != "paged_adamw_32bit" and n >= BNB_MIN_8BIT:
                eight_bit = True
                states, blocks = 2 * _block(n), (n + BNB_BLOCK - 1) // BNB_BLOCK
                device += k * 2 * _block(blocks * 4)
            else:
                states = 2 * _block(n * 4)
            if name.startswith("paged") and n >= BNB_PAGED_MIN:
                paged += k * states
            else:
                device += k * states
        elif name == "adafactor":
            device += k * _block(4)  # its RMS, a one-element tensor on the card
            if len(shape) >= 2:
                device += k * (_block(prod(shape[:-1]) * param_bytes) + _block(prod(shape[:-2] + shape[-1:]) * param_bytes))
            else:
                device += k * _block(n * param_bytes)
    if eight_bit:
        device += 2 * _block(256 * 4)  # the two quantile maps, shared by every tensor
    return OptimizerState(name, device, paged, sum(counts.values()))
