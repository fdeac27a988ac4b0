# The m3stack engine: torch, the M3 model and the embedded tiny model, on CPU or on NVIDIA GPUs.
# `scripts/dev images` builds it on a base made from Debian's archive (images/README.md); anywhere else,
# from the repository root:
#   docker build -f images/engine.Dockerfile -t m3stack/engine:0.1.0 .                               # CPU
#   docker build -f images/engine.Dockerfile --build-arg DEVICE=cuda -t m3stack/engine:0.1.0-cuda .   # GPUs
# DEVICE=cpu takes torch from TORCH_INDEX_URL (PyPI: the CUDA build, which also runs on CPU;
# https://download.pytorch.org/whl/cpu gives a much smaller CPU-only image). DEVICE=cuda adds FlashInfer
# and what its JIT compiles kernels with (nvcc from PyPI's CUDA toolkit, g++); its kernel cache goes to
# $FLASHINFER_WORKSPACE_BASE. torch is pinned here, everything else by images/constraints.txt.
ARG BASE_IMAGE=python:3.11.14-slim-bookworm
# uv installs the dependencies: parallel downloads, and a cache images/build mounts at UV_CACHE_DIR. Each
# RUN that needs it installs it under /tmp and removes it, so no image carries it.
ARG UV_VERSION=0.13.9

# The dependency list first (it changes only with pyproject.toml's dependencies), then the project's wheel.
FROM ${BASE_IMAGE} AS wheel
ARG UV_VERSION
# A TLS-intercepting proxy's certificates, for pip and uv (images/build mounts the host's bundle for the
# build only); unset elsewhere.
ARG PIP_CERT
ARG SSL_CERT_FILE
ARG UV_NO_CACHE=1
ARG UV_CACHE_DIR=/var/cache/uv
RUN python3 -m venv /opt/uv && /opt/uv/bin/pip install --no-cache-dir "uv==${UV_VERSION}"
WORKDIR /src
COPY pyproject.toml images/requirements.py ./
RUN python3 requirements.py pyproject.toml engine --exclude torch > /requirements.txt
COPY setup.py README.md ./
COPY m3stack m3stack
COPY engine engine
COPY gateway gateway
COPY operator operator
RUN /opt/uv/bin/uv build --wheel --out-dir /wheels .

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG DEVICE=cpu
ARG TORCH_VERSION=2.15.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG FLASHINFER_VERSION=0.6.13
# The CUDA toolkit torch's wheel pins (its nvcc compiles FlashInfer's kernels).
ARG CUDA_TOOLKIT_VERSION=13.2.2
ARG UV_VERSION
ARG PIP_CERT
ARG SSL_CERT_FILE
ARG UV_NO_CACHE=1
ARG UV_CACHE_DIR=/var/cache/uv
LABEL org.opencontainers.image.title="m3stack-engine" \
      org.opencontainers.image.description="m3stack inference engine: MiniMax-M3 with MSA sparse attention, on CPU or GPUs" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/m3stack/m3stack" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN if [ "${DEVICE}" != cpu ] && [ "${DEVICE}" != cuda ]; then echo "DEVICE=${DEVICE}: cpu or cuda" >&2; exit 1; fi \
    && groupadd --gid 10001 m3stack \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin m3stack
# FlashInfer's JIT needs a host C++ compiler next to nvcc.
RUN if [ "${DEVICE}" = cuda ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi
ENV UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=never
# torch alone: its gigabytes stay one layer that only new torch arguments rebuild.
RUN python3 -m venv /tmp/uv && /tmp/uv/bin/pip install --no-cache-dir "uv==${UV_VERSION}" \
    && python3 -m venv /opt/m3stack \
    && /tmp/uv/bin/uv pip install --python /opt/m3stack/bin/python --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" \
    && rm -rf /tmp/uv
COPY --from=wheel /requirements.txt /opt/m3stack/share/requirements.txt
COPY images/constraints.txt /opt/m3stack/share/constraints.txt
RUN python3 -m venv /tmp/uv && /tmp/uv/bin/pip install --no-cache-dir "uv==${UV_VERSION}" \
    && /tmp/uv/bin/uv pip install --python /opt/m3stack/bin/python \
        --constraint /opt/m3stack/share/constraints.txt --requirement /opt/m3stack/share/requirements.txt \
    && if [ "${DEVICE}" = cuda ]; then \
        /tmp/uv/bin/uv pip install --python /opt/m3stack/bin/python --constraint /opt/m3stack/share/constraints.txt \
            "flashinfer-python==${FLASHINFER_VERSION}" "cuda-toolkit[nvcc,cudart,cccl]==${CUDA_TOOLKIT_VERSION}" \
        && ln -s "$(/opt/m3stack/bin/python -c 'import nvidia; print(list(nvidia.__path__)[0])')/cu13" /usr/local/cuda; \
    fi \
    && rm -rf /tmp/uv
# The project itself: a small layer of its own, the only one a code change rebuilds (no network).
COPY --from=wheel /wheels /opt/m3stack/share/wheels
RUN /opt/m3stack/bin/python -m pip install --no-cache-dir --no-index --no-deps /opt/m3stack/share/wheels/m3stack-*.whl
ENV PATH=/opt/m3stack/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    FLASHINFER_WORKSPACE_BASE=/tmp \
    M3STACK_ENGINE_DEVICE=${DEVICE} \
    M3STACK_CACHE=/opt/m3stack/cache
# `--model default`: the tiny random-weight model, generated (seeded) into the image, read-only at run time;
# the gateway image holds the same tokenizer and config files (images/README.md says why).
RUN m3stack model init-tiny
USER 10001:10001
EXPOSE 50051 9400
ENTRYPOINT ["m3stack"]
CMD ["engine", "--host", "0.0.0.0"]
