"""Engine tests: a package, so its kernels/, layers/ and models/ folders import as tests.engine.*, never as the top-level
names of installed packages (transformers 5.25 imports the `kernels` package from the Hub)."""
