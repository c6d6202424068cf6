// Kernels let go of the GIL while they run, so other Python threads (the replica's event loop) go on meanwhile.
// A kernel called from another kernel (decoder_cpu.cpp) already runs without it, so it is released only if held.
// cpu_kernels.py puts this file first in the one translation unit it builds from engine/csrc.
#pragma once
#include <pybind11/pybind11.h>

#include <optional>

class ReleaseGil {
 public:
  ReleaseGil() {
    if (PyGILState_Check()) released_.emplace();
  }

 private:
  std::optional<pybind11::gil_scoped_release> released_;
};
