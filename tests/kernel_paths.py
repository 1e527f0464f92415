"""The arithmetic of dspark's CPU kernels as test parameters: AVX512-BF16 dot products, or AMX
tiles where the CPU has them; each skipped, with its reason, where this machine lacks it."""

import pytest

from dspark.kernels import cpu as cpu_kernels

PATH_MARKS = {
    False: pytest.mark.skipif(not cpu_kernels.available(), reason="needs AVX512-BF16 and a C++ compiler"),
    True: pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs AMX and a C++ compiler"),
}
KERNEL_PATHS = [pytest.param(amx, marks=PATH_MARKS[amx], id="amx" if amx else "vector") for amx in (False, True)]
