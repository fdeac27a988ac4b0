# The m3stack engine: CUDA, torch, FlashInfer and the M3 model. Build from the repository root:
#   docker build -f images/engine.Dockerfile -t ghcr.io/m3stack/engine:0.1.0 .
# torch and FlashInfer are the versions the GPU suite runs with on the H200 (shared/gpu/README.md);
# everything else is pinned by images/constraints.txt. The runtime keeps the CUDA toolkit because
# FlashInfer compiles kernel variants on first use (its cache goes to $FLASHINFER_WORKSPACE_BASE).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.9.5

FROM ${UV_IMAGE} AS uv

FROM ${CUDA_IMAGE} AS build
ARG PYTHON_VERSION=3.12.12
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG FLASHINFER_VERSION=0.6.13
ARG TVM_FFI_VERSION=0.1.15.post2
ARG CUDNN_FRONTEND_VERSION=1.32.0
COPY --from=uv /uv /usr/local/bin/uv
# A standalone CPython (no distribution packages to pin), installed where the runtime stage copies it from.
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1 \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1
RUN uv python install "${PYTHON_VERSION}" \
    && uv venv --python "${PYTHON_VERSION}" /opt/m3stack \
    && uv pip install --python /opt/m3stack/bin/python --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY images/constraints.txt images/constraints.txt
COPY m3stack m3stack
COPY engine engine
COPY gateway gateway
COPY operator operator
RUN uv pip install --python /opt/m3stack/bin/python --constraint images/constraints.txt \
        "flashinfer-python==${FLASHINFER_VERSION}" \
        "apache-tvm-ffi==${TVM_FFI_VERSION}" \
        "nvidia-cudnn-frontend==${CUDNN_FRONTEND_VERSION}" \
        ".[engine]"

FROM ${CUDA_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="m3stack-engine" \
      org.opencontainers.image.description="m3stack inference engine: MiniMax-M3 with MSA sparse attention on GPUs" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/m3stack/m3stack" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 m3stack \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin m3stack
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/m3stack /opt/m3stack
ENV PATH=/opt/m3stack/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    FLASHINFER_WORKSPACE_BASE=/tmp
USER 10001:10001
EXPOSE 50051 9400
ENTRYPOINT ["m3stack"]
CMD ["engine", "--device", "cuda", "--host", "0.0.0.0"]
