# One image for every service (entrypoint `rlhf`). Two flavours:
#   gpu (default): vLLM and the CUDA torch it pins (PyPI), for `docker compose up` on a GPU box
#   cpu:           the CPU build of torch, for machines without a GPU (the tiny default)
#
#   docker build -t rlhf:gpu .
#   docker build -t rlhf:cpu --build-arg FLAVOUR=cpu .
#
# Build arguments:
#   BASE_IMAGE      a Debian-based image with python3 (3.10+) and python3-venv
#   FLAVOUR         gpu | cpu
#   TORCH_SPEC      the torch requirement (gpu: empty = the CUDA torch vLLM is built against, from
#                   PyPI; cpu: the pinned CPU wheel)
#   TORCH_INDEX_URL where torch comes from (cpu default: PyTorch's CPU wheel index)
#   VLLM_SPEC       the vLLM of the gpu flavour (default vllm==0.32.0, the release this is tested with)
#   Wheels put in docker/wheels/ (a local wheelhouse) are used where they match what the index
#   offers; docker/ci-setup.sh fills it with torch's CPU wheel (used by the cpu flavour only) and
#   every dependency.
ARG BASE_IMAGE=python:3.11-slim-bookworm

# The system part of the runtime (first, so `--target runtime-base` builds nothing else). The gpu
# flavour needs a C compiler and Python's headers: vLLM's compiled path (torch.compile -> Triton)
# builds Triton's CUDA launcher, a C extension, with `cc` at the first model load, and a slim
# image has neither ("Failed to find C compiler").
FROM ${BASE_IMAGE} AS runtime-base
ARG FLAVOUR=gpu
RUN set -eu; \
    if [ "$FLAVOUR" = gpu ]; then \
      headers=$(python3 -c 'import os, sysconfig; print("" if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")'); \
      apt-get update -qq; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev $headers >/dev/null; \
      rm -rf /var/lib/apt/lists/*; \
    fi
RUN (id rlhf >/dev/null 2>&1 || useradd --uid 10001 --create-home --shell /usr/sbin/nologin rlhf) \
    && mkdir -p /runs /data /workspace && chown rlhf /runs /data

FROM ${BASE_IMAGE} AS build
ARG FLAVOUR=gpu
ARG TORCH_SPEC=""
ARG TORCH_INDEX_URL=""
ARG VLLM_SPEC="vllm==0.32.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_FIND_LINKS=/wheels
COPY docker/wheels/ /wheels/
# a current pip: the base's may be old enough to backtrack through vLLM releases for minutes
RUN python3 -m venv /opt/rlhf && /opt/rlhf/bin/pip install --upgrade pip
# the gpu flavour never takes a CPU build of torch from the wheelhouse (`make test-docker` puts one
# there, and it satisfies vLLM's torch pin by version: the image would have no CUDA)
RUN set -eu; \
    [ "$FLAVOUR" != gpu ] || rm -f /wheels/torch-*+cpu*.whl; \
    case "$FLAVOUR" in \
      gpu) spec="${TORCH_SPEC:-}"; index="${TORCH_INDEX_URL:-}";; \
      cpu) spec="${TORCH_SPEC:-torch==2.13.0}"; index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}";; \
      *) echo "FLAVOUR must be gpu or cpu, not $FLAVOUR" >&2; exit 2;; \
    esac; \
    if [ "$FLAVOUR" = cpu ] && ls /wheels/torch-*.whl >/dev/null 2>&1; then \
      /opt/rlhf/bin/pip install /wheels/torch-*.whl; \
    elif [ -n "$spec" ]; then \
      /opt/rlhf/bin/pip install ${index:+--index-url "$index"} "$spec"; \
    fi
# the dependencies in a layer of their own (an empty package stands in for the code), so a change
# of the code rebuilds only the last layer
WORKDIR /src
COPY pyproject.toml ./
RUN set -eu; extras=""; vllm=""; [ "$FLAVOUR" = gpu ] && extras="[vllm]" && vllm="$VLLM_SPEC"; \
    mkdir services && touch services/__init__.py README.md; \
    /opt/rlhf/bin/pip install ".${extras}" $vllm; \
    /opt/rlhf/bin/pip uninstall -y rlhf-services; rm -rf services build README.md
COPY README.md ./
COPY services/ services/
RUN /opt/rlhf/bin/pip install --no-deps . && rm -rf build

FROM runtime-base AS runtime
COPY --from=build /opt/rlhf /opt/rlhf
COPY configs/ /app/configs/
# models named by hub id download into $HF_HOME (compose puts it on the runs volume); a config is
# a path or a name looked up in the user's workspace (compose mounts it at /workspace) first
ENV PATH=/opt/rlhf/bin:$PATH PYTHONUNBUFFERED=1 RLHF_CONFIG_PATH=/workspace/configs:/app/configs
WORKDIR /app
USER rlhf
ENTRYPOINT ["rlhf"]
CMD ["--help"]
