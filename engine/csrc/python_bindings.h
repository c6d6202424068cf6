// What the Python bindings at the end of the translation unit need (cpu_kernels.py has torch generate them): pybind11's
// casters for ATen tensors and torch's translation of C++ errors into Python exceptions. Only this, and each kernel
// file includes the ATen headers it uses: torch/extension.h, which load_inline would put first otherwise, is all of
// libtorch's C++ API, and the unit built in 58 s with it, 33 s without (2-core Zen 4).
#pragma once
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
