"""A fused linear cross-entropy (the ``fused_linear_ce`` memory fix): Liger Kernel's, as
``transformers`` switches it on with ``TrainingArguments(use_liger_kernel=True,
liger_kernel_config={"fused_linear_cross_entropy": True, ...})`` and the model's other Liger
kernels off. The model's forward becomes Liger's (``_apply_liger_kernel_to_instance``): in training
with labels the lm_head is never called; the loss and the gradient of the hidden states are
computed chunk by chunk in the forward (Liger's ``fused_linear_cross_entropy_forward``), so the
logits exist one chunk of tokens at a time and nothing of the sequence's vocabulary-wide logits
is saved for backward.

On a GPU (CUDA, and ROCm through the same device type) Liger runs as it is, Triton kernels and all.
Elsewhere its Python runs as it is and only what Triton would run is stood in (``kernels``):

- the cross-entropy kernel (each row of a logits chunk turned into its gradient in place, its loss
  written to ``loss_1d``): on real CPU tensors the same arithmetic in torch, a row at a time (one
  row's fp32 temporaries, what the kernel holds in registers); under fake tensors nothing, as
  the kernel allocates nothing;
- the in-place scaling of the saved gradients in backward (``element_mul_kernel``);
- Liger's test for its CUDA matmul path (``_can_use_mm_out``, which reuses one logits buffer for
  every chunk), answered as on a CUDA card, so the CPU step allocates what the card allocates;
- under fake tensors, the count of non-ignored tokens (``.item()``) and the test for a unit
  upstream gradient (``torch.equal``), values a fake tensor does not have: they only scale what the
  kernels compute, which the dry run does not compute.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

#: Every kernel Liger's per-model functions can switch on, off but the fused linear cross-entropy.
_OTHERS_OFF = {name: False for name in ("rope", "cross_entropy", "rms_norm", "layer_norm", "swiglu", "geglu",
                                        "poly_norm", "fused_add_rms_norm", "fused_moe")}


class LigerMissing(Exception):
    """liger-kernel is not installed (``pip install 'vram-ledger[liger]'``)."""


def apply(model: torch.nn.Module) -> None:
    """Switch Liger's fused linear cross-entropy on for this model instance, as the Trainer does
    (on the PEFT model's base), every other Liger kernel off."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise LigerMissing(f"fused_linear_ce needs liger-kernel ({exc}); pip install 'vram-ledger[liger]'") from None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _apply_liger_kernel_to_instance(model=base, fused_linear_cross_entropy=True, **_OTHERS_OFF)


def _cross_entropy_rows(*, X_ptr, Y_ptr, loss_ptr, n_non_ignore, ignore_index, reduction, softcap,
                        HAS_GRADIENTS, weight_ptr=None, label_smoothing=0.0, lse_square_scale=0.0,
                        RETURN_Z_LOSS=False, RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
                        **_) -> None:
    """Liger's cross-entropy kernel for the plain loss, in torch: each row of ``X`` (logits) becomes
    d loss / d logits in place, its loss goes to ``loss_ptr``."""
    if weight_ptr is not None or label_smoothing or lse_square_scale or RETURN_Z_LOSS \
            or RETURN_TOKEN_ACCURACY or RETURN_PREDICTED_TOKENS:
        raise NotImplementedError("the CPU stand-in computes the plain cross-entropy only")
    X, Y, loss = X_ptr, Y_ptr, loss_ptr
    scale = 1.0 / n_non_ignore if reduction == "mean" and n_non_ignore else 1.0
    for i in range(X.shape[0]):
        y = int(Y[i])
        if y == ignore_index:
            X[i].zero_()
            loss[i] = 0.0
            continue
        x = X[i].float()
        if softcap is not None:
            x = softcap * torch.tanh(x / softcap)
        lse = torch.logsumexp(x, dim=0)
        loss[i] = (lse - x[y]) * scale
        if HAS_GRADIENTS:
            grad = torch.exp(x - lse)
            grad[y] -= 1.0
            if softcap is not None:
                grad *= 1.0 - (x / softcap) ** 2
            X[i].copy_(grad * scale)


def _scale_rows(X_ptr, X_stride, grad_output_ptr, n_cols, **_) -> None:
    X_ptr.mul_(grad_output_ptr.to(X_ptr.dtype))


class _Launch:
    """What ``kernel[grid](...)`` runs in place of a Triton kernel: ``run(**arguments)``, or nothing."""

    def __init__(self, run=None):
        self.run = run

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.run is not None:
                self.run(*args, **kwargs)
        return launch


def _mm_out_as_on_cuda(_input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Liger's ``_can_use_mm_out`` without its device test: the logits buffer is made once and
    reused for every chunk, as on a CUDA card."""
    return (not torch.is_grad_enabled() and _input.dtype == weight.dtype
            and _input.dtype in (torch.float16, torch.bfloat16, torch.float32) and not torch.is_autocast_enabled())


@contextlib.contextmanager
def kernels(device: torch.device, fake: bool = False) -> Iterator[None]:
    """Liger's Triton kernels stood in where Triton does not run (see the module docstring);
    on a CUDA / ROCm device nothing changes."""
    import warnings

    with warnings.catch_warnings():
        # Liger's forward passes transformers' older cache argument names; that warning, and only it, is silenced.
        warnings.filterwarnings("ignore", message=r".*(past_key_values|cache_params).* deprecated", category=FutureWarning)
        if device.type == "cuda":
            yield
        else:
            with _stood_in(fake):
                yield


@contextlib.contextmanager
def _stood_in(fake: bool) -> Iterator[None]:
    import liger_kernel.ops.fused_linear_cross_entropy as flce

    saved = {name: getattr(flce, name) for name in
             ("liger_cross_entropy_kernel", "element_mul_kernel", "_can_use_mm_out", "fused_linear_cross_entropy_backward")}
    flce.liger_cross_entropy_kernel = _Launch(None if fake else _cross_entropy_rows)
    flce.element_mul_kernel = _Launch(None if fake else _scale_rows)
    flce._can_use_mm_out = _mm_out_as_on_cuda
    item = torch.Tensor.item
    if fake:
        from torch._subclasses.fake_tensor import FakeTensor

        def fake_item(self):
            return 1 if isinstance(self, FakeTensor) else item(self)

        def backward(grad_output, grad_input, grad_weight, grad_bias):
            return grad_input, grad_weight, grad_bias  # the in-place scaling allocates nothing

        torch.Tensor.item = fake_item
        flce.fused_linear_cross_entropy_backward = backward
    try:
        yield
    finally:
        torch.Tensor.item = item
        for name, value in saved.items():
            setattr(flce, name, value)
