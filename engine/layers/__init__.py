"""The building blocks of the native models, one concept per file (the nano-vllm layout)."""
