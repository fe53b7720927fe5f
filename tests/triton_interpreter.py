"""Runs Triton kernels on the CPU through Triton's interpreter when no GPU is present.

Import this before `triton` in a kernel test and call `interpret_without_cuda()` first thing:
it sets `TRITON_INTERPRET=1` (read when kernels are defined) and patches the interpreter gaps
our kernels hit.
"""

from __future__ import annotations

import os

import torch


def interpret_without_cuda() -> bool:
    """Switches Triton to its interpreter when CUDA is absent (unless `TRITON_INTERPRET` is
    already set) and, whenever `TRITON_INTERPRET=1`, patches its gaps; returns whether the
    interpreter is in use."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    _fix_interpreter()
    return True


def _fix_interpreter() -> None:
    """The Triton-interpreter gaps our kernels hit, patched for the interpreter only.

    Each patch marks what it installs (`_phaseflip_fixed`), so calling this again is a no-op;
    nothing is patched when triton is not installed (the tests then skip).

    1. `tensor.__index__` is `int(data)` on a 1-element 1-d array in Triton <= 3.6, an error
       since NumPy 2.4, so a loaded or program-id-derived scalar cannot bound a `range`; later
       Triton squeezes first.
    2. `tl.dot` on bfloat16 multiplies the raw uint16 storage (still so in 3.9); widen
       bfloat16 operands to float32 exactly (bits << 16), which is what the GPU's bf16 MMA with
       fp32 accumulation computes.
    3. float32 -> bfloat16 casts truncate the mantissa (3.6, still in 3.9; its RTNE mode does
       not carry), where the GPU rounds to nearest even, as torch does; cast on the raw bits
       instead (round to nearest even, NaN kept quiet), and bfloat16 -> float32 exactly.
    4. A block mask `&` a scalar condition (`(offs < n) & (pos >= 0)`) holds int32 data under an
       int1 type in 3.9, and masked loads/stores then refuse it ("mask has unsupported dtype");
       a mask is a truth value, so it is made boolean first.
    5. Casts to float8e4nv (e4m3) drop the carry of a mantissa rounded up into the exponent
       (3.9: 124.5 -> 64 instead of 128); in-range values are converted by torch instead
       (round to nearest even, as the GPU's cvt.rn does).
    6. Casts from float8e4nv read its NaN (0x7F, 0xFF) as 480 (3.9), where the GPU widens it
       to NaN; widened by torch instead (exact for every other value).
    """
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is not None and not getattr(patch, "_phaseflip_fixed", False):

        def patched(tensor, scope) -> None:
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._phaseflip_fixed = True  # type: ignore[attr-defined]
        interpreter._patch_lang_tensor = patched

    builder = type(interpreter.interpreter_builder)

    def bf16_to_fp32(data):
        return (data.astype(np.uint32) << 16).view(np.float32)

    dot = builder.create_dot
    if not getattr(dot, "_phaseflip_fixed", False):

        def widen(h):
            if h.dtype == tl.bfloat16:
                return interpreter.TensorHandle(bf16_to_fp32(h.data), tl.float32)
            return h

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        create_dot._phaseflip_fixed = True  # type: ignore[attr-defined]
        builder.create_dot = create_dot

    cast = builder.cast_impl
    if not getattr(cast, "_phaseflip_fixed", False):

        def cast_impl(self, src, dst_type):
            s, d = src.dtype.scalar, dst_type.scalar
            if s == tl.float32 and d == tl.bfloat16:
                u = src.data.astype(np.float32).view(np.uint32)
                rne = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
                nan = ((u >> 16) | 0x40).astype(np.uint16)
                return interpreter.TensorHandle(np.where(np.isnan(src.data), nan, rne), d)
            if s == tl.bfloat16 and d == tl.float32:
                return interpreter.TensorHandle(bf16_to_fp32(src.data), d)
            return cast(self, src, dst_type)

        cast_impl._phaseflip_fixed = True  # type: ignore[attr-defined]
        builder.cast_impl = cast_impl

    fp_to_fp = builder.create_fp_to_fp
    if not getattr(fp_to_fp, "_phaseflip_fixed", False):

        def create_fp_to_fp(self, src, dst_type, rounding_mode):
            if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32,
                                                                            tl.bfloat16):
                data = src.data if src.dtype.scalar == tl.float32 else bf16_to_fp32(src.data)
                t = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
                bits = t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
                return interpreter.TensorHandle(bits, dst_type.scalar)
            wide = {tl.float16: torch.float16, tl.float32: torch.float32}
            if src.dtype.scalar == tl.float8e4nv and dst_type.scalar in wide:
                bits = torch.from_numpy(np.ascontiguousarray(src.data).view(np.uint8))
                out = bits.view(torch.float8_e4m3fn).to(wide[dst_type.scalar]).numpy()
                return interpreter.TensorHandle(out, dst_type.scalar)
            return fp_to_fp(self, src, dst_type, rounding_mode)

        create_fp_to_fp._phaseflip_fixed = True  # type: ignore[attr-defined]
        builder.create_fp_to_fp = create_fp_to_fp

    load, store = builder.create_masked_load, builder.create_masked_store
    if not getattr(load, "_phaseflip_fixed", False):

        def as_bool(mask):
            if mask.data.dtype == np.bool_:
                return mask
            return interpreter.TensorHandle(mask.data.astype(np.bool_), tl.int1)

        def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
            return load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

        def create_masked_store(self, ptrs, value, mask, cache_policy):
            return store(self, ptrs, value, as_bool(mask), cache_policy)

        create_masked_load._phaseflip_fixed = True  # type: ignore[attr-defined]
        builder.create_masked_load = create_masked_load
        builder.create_masked_store = create_masked_store
