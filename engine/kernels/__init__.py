"""GPU kernels (Triton), checked on every machine; the CPU kernels are C++ under engine/csrc."""
