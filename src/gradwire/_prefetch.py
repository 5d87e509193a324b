"""Software prefetch for the numba kernels' scattered loops (imported only from ``gradwire._native``).

A scatter (``target[positions[i]] += values[i]``) or a strided gather over a tensor larger than the
cache misses on nearly every element, and with 4 KiB pages often in the TLB too. Out-of-order
execution overlaps only the misses of the few iterations in its window; asking for the element
:data:`AHEAD` iterations ahead keeps many more in flight. ResNet-18's error-feedback scatters
(248k sorted positions over 16 tensors of 0.6-2.4M float32, caches flushed before each round):
3.7-4.1 ms without, 1.9 ms at 32 ahead, 1.7-1.9 ms at 64-256 (a probe script, not kept;
``scripts/kernel_bench.py`` prints the scatter's row).

``prefetch_read(array, index)`` / ``prefetch_write(array, index)`` emit LLVM's ``llvm.prefetch``
for ``&array[index]``. A prefetch never faults, so an index outside the array (a hostile
position, which the caller rejects before it writes) costs nothing but a wasted hint. Where this
numba cannot emit the intrinsic (it is checked once, by compiling a probe), both are no-ops, and
the kernels give the same results, only slower.
"""

from __future__ import annotations

import numba
import numpy as np

#: iterations ahead that a scattered loop asks for (a constant: numba freezes module globals)
AHEAD = 64


def _prefetch_intrinsic(write: bool):
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def prefetch(typingctx, array, index):
        if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            view = context.make_array(array_type)(context, builder, args[0])
            address = builder.gep(view.data, [args[1]])
            byte_pointer = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            function = builder.module.declare_intrinsic(
                "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]))
            # (address, 1 = write / 0 = read, locality 3 = keep in every cache level, 1 = data)
            builder.call(function, [builder.bitcast(address, byte_pointer), ir.Constant(i32, int(write)),
                                    ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    return prefetch


def _no_op():
    @numba.njit(inline="always")
    def prefetch(array, index):
        pass

    return prefetch


#: whether the kernels got the hint (False: the no-ops stand in; ``tests/test_kernels.py`` expects True)
EMITTED = True
prefetch_read = _prefetch_intrinsic(write=False)
prefetch_write = _prefetch_intrinsic(write=True)


@numba.njit(cache=True)
def _probe(array: np.ndarray) -> None:
    prefetch_read(array, 0)
    prefetch_write(array, 0)


try:
    _probe(np.zeros(1, dtype=np.float32))
except Exception:  # any failure to emit the hint: run without it
    EMITTED = False
    prefetch_read = _no_op()
    prefetch_write = _no_op()
