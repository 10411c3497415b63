"""Kernel-test setup: make Triton 3.6's interpreter work with NumPy >= 2.4.

The interpreter holds scalars as 1-element arrays and converts them with
`int(array)`, which NumPy 2.4 refuses for arrays of ndim > 0; every `range()` with
run-time bounds inside a kernel then fails. Convert through `.item()` instead.
Remove this once Triton's interpreter does so itself.
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter

    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor_item(tensor, scope) -> None:
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = _patch_lang_tensor_item
