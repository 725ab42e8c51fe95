# One image for every service (entrypoint `rlhf`). Two flavours:
#   gpu (default): CUDA torch from PyPI + vLLM, for `docker compose up` on a GPU box
#   cpu:           the CPU build of torch, for machines without a GPU (the tiny default)
#
#   docker build -t rlhf:gpu .
#   docker build -t rlhf:cpu --build-arg FLAVOUR=cpu .
#
# Build arguments:
#   BASE_IMAGE      a Debian-based image with python3 (3.10+) and python3-venv
#   FLAVOUR         gpu | cpu
#   TORCH_SPEC      the torch requirement (gpu: PyPI's CUDA build; cpu: pinned CPU wheel)
#   TORCH_INDEX_URL where torch comes from (cpu default: PyTorch's CPU wheel index)
#   Wheels put in docker/wheels/ (a local wheelhouse) are used where they match what the index
#   offers; docker/ci-setup.sh fills it with torch's CPU wheel and every dependency.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG FLAVOUR=gpu
ARG TORCH_SPEC=""
ARG TORCH_INDEX_URL=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_FIND_LINKS=/wheels
RUN python3 -m venv /opt/rlhf
COPY docker/wheels/ /wheels/
RUN set -eu; \
    case "$FLAVOUR" in \
      gpu) spec="${TORCH_SPEC:-torch}"; index="${TORCH_INDEX_URL:-}";; \
      cpu) spec="${TORCH_SPEC:-torch==2.13.0}"; index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}";; \
      *) echo "FLAVOUR must be gpu or cpu, not $FLAVOUR" >&2; exit 2;; \
    esac; \
    if ls /wheels/torch-*.whl >/dev/null 2>&1; then \
      /opt/rlhf/bin/pip install /wheels/torch-*.whl; \
    else \
      /opt/rlhf/bin/pip install ${index:+--index-url "$index"} "$spec"; \
    fi
# the dependencies in a layer of their own (an empty package stands in for the code), so a change
# of the code rebuilds only the last layer
WORKDIR /src
COPY pyproject.toml ./
RUN set -eu; extras=""; [ "$FLAVOUR" = gpu ] && extras="[vllm]"; \
    mkdir services && touch services/__init__.py README.md; \
    /opt/rlhf/bin/pip install ".${extras}"; \
    /opt/rlhf/bin/pip uninstall -y rlhf-services; rm -rf services build README.md
COPY README.md ./
COPY services/ services/
RUN /opt/rlhf/bin/pip install --no-deps . && rm -rf build

FROM ${BASE_IMAGE} AS runtime
RUN (id rlhf >/dev/null 2>&1 || useradd --uid 10001 --create-home --shell /usr/sbin/nologin rlhf) \
    && mkdir -p /runs /data && chown rlhf /runs /data
COPY --from=build /opt/rlhf /opt/rlhf
COPY configs/ /app/configs/
# models named by hub id download into $HF_HOME (compose puts it on the runs volume)
ENV PATH=/opt/rlhf/bin:$PATH PYTHONUNBUFFERED=1
WORKDIR /app
USER rlhf
ENTRYPOINT ["rlhf"]
CMD ["--help"]
