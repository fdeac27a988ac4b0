# The m3stack operator (kopf + the Kubernetes client; no torch). Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/m3stack/operator:0.1.0 .
# Dependencies are pinned by images/constraints.txt (the versions CI tests with).
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY images/constraints.txt images/constraints.txt
COPY m3stack m3stack
COPY engine engine
COPY gateway gateway
COPY operator operator
RUN python -m venv /opt/m3stack \
    && /opt/m3stack/bin/pip install --no-cache-dir --constraint images/constraints.txt ".[operator]"

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="m3stack-operator" \
      org.opencontainers.image.description="Kubernetes operator reconciling M3Deployment resources" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/m3stack/m3stack" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 m3stack \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin m3stack
COPY --from=build /opt/m3stack /opt/m3stack
ENV PATH=/opt/m3stack/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["m3stack"]
CMD ["operator"]
