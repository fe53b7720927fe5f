"""Runs Triton kernels on the CPU through Triton's interpreter when no GPU is present.

Import this before `triton` in a kernel test and call `interpret_without_cuda()` first thing:
it sets `TRITON_INTERPRET=1` (read when kernels are defined) and patches the interpreter gaps
our kernels hit.
"""

from __future__ import annotations

import os

import torch


def interpret_without_cuda() -> bool:
    """Switches Triton to its interpreter when CUDA is absent; returns whether it did."""
    if torch.cuda.is_available():
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        _fix_interpreter()
    return True


def _fix_interpreter() -> None:
    """Two Triton-interpreter gaps our kernels hit, patched for the interpreter only.

    1. `tensor.__index__` is `int(data)` on a 1-element 1-d array in Triton <= 3.6, an error
       since NumPy 2.4, so a loaded scalar cannot bound a `range`; later Triton squeezes first.
    2. `tl.dot` on bfloat16 multiplies the raw uint16 storage (still so in 3.9); widen
       bfloat16 operands to float32 exactly (bits << 16), which is what the GPU's bf16 MMA with
       fp32 accumulation computes.
    """
    import numpy as np
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is not None and not getattr(patch, "_phaseflip_fixed", False):

        def patched(tensor, scope) -> None:
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._phaseflip_fixed = True  # type: ignore[attr-defined]
        interpreter._patch_lang_tensor = patched

    builder = type(interpreter.interpreter_builder)
    dot = builder.create_dot
    if not getattr(dot, "_phaseflip_fixed", False):
        import triton.language as tl

        def widen(h):
            if h.dtype == tl.bfloat16:
                data = (h.data.astype(np.uint32) << 16).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return h

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        create_dot._phaseflip_fixed = True  # type: ignore[attr-defined]
        builder.create_dot = create_dot
