# The m3stack gateway: OpenAI-compatible API, tokenization, image/video preprocessing (PyAV wheels
# bundle FFmpeg), routing to engines over gRPC; no torch. `scripts/dev images` builds it on a base made
# from Debian's archive (images/README.md); anywhere else, from the repository root:
#   docker build -f images/gateway.Dockerfile -t m3stack/gateway:0.1.0 .
# Dependencies are pinned by images/constraints.txt (the versions CI tests with).
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
RUN python3 requirements.py pyproject.toml gateway > /requirements.txt
COPY setup.py README.md ./
COPY m3stack m3stack
COPY engine engine
COPY gateway gateway
COPY operator operator
RUN /opt/uv/bin/uv build --wheel --out-dir /wheels .

FROM ${BASE_IMAGE}
ARG VERSION=0.1.0
ARG UV_VERSION
ARG PIP_CERT
ARG SSL_CERT_FILE
ARG UV_NO_CACHE=1
ARG UV_CACHE_DIR=/var/cache/uv
LABEL org.opencontainers.image.title="m3stack-gateway" \
      org.opencontainers.image.description="OpenAI-compatible gateway in front of m3stack engines" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/m3stack/m3stack" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 m3stack \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin m3stack
ENV UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=never
COPY --from=wheel /requirements.txt /opt/m3stack/share/requirements.txt
COPY images/constraints.txt /opt/m3stack/share/constraints.txt
RUN python3 -m venv /tmp/uv && /tmp/uv/bin/pip install --no-cache-dir "uv==${UV_VERSION}" \
    && python3 -m venv /opt/m3stack \
    && /tmp/uv/bin/uv pip install --python /opt/m3stack/bin/python \
        --constraint /opt/m3stack/share/constraints.txt --requirement /opt/m3stack/share/requirements.txt \
    && rm -rf /tmp/uv
# The project itself: a small layer of its own, the only one a code change rebuilds (no network).
COPY --from=wheel /wheels /opt/m3stack/share/wheels
RUN /opt/m3stack/bin/python -m pip install --no-cache-dir --no-index --no-deps /opt/m3stack/share/wheels/m3stack-*.whl
ENV PATH=/opt/m3stack/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    M3STACK_CACHE=/opt/m3stack/cache
# `--model default`: the tiny model's tokenizer, chat template and configs, the same files the engine
# image generates (no torch here, so no weights: the gateway never reads them).
RUN m3stack model init-tiny --no-weights
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["m3stack"]
CMD ["gateway", "--host", "0.0.0.0"]
