#!/usr/bin/env bash
# Docker for the compose tests (tests/compose/) on a machine like CI's: Debian, root, package
# registries reachable but no image registry. Idempotent; each step is skipped when its result is
# already there, so a warm machine pays seconds.
#
#   1. Docker Engine, docker-compose (v1) and debootstrap from Debian's packages, if missing
#   2. dockerd, if not running (log in $DOCKERD_LOG)
#   3. the local base image $BASE_IMAGE (debootstrap'd Debian + python3): a stand-in for the public
#      python image, which cannot be pulled here
#   4. a wheelhouse (docker/wheels): the CPU torch wheel and every dependency, built on the host
#      (from pip's cache when warm), so the image build downloads next to nothing
#   5. the CPU image $IMAGE (docker build; cached layers make a rebuild seconds)
#
# Environment: BASE_IMAGE (rlhf-base:bookworm), IMAGE (rlhf:cpu), PIP (the pip that builds the
# wheelhouse: .venv/bin/pip), DEBIAN_MIRROR (apt's configured mirror), TORCH (torch==2.13.0+cpu),
# PRUNE (1: the build stage's image, 2 GB, and the wheelhouse are removed once the image is built,
# for a CI machine short of disk; a later build then starts from scratch).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE=${BASE_IMAGE:-rlhf-base:bookworm}
IMAGE=${IMAGE:-rlhf:cpu}
PIP=${PIP:-.venv/bin/pip}
# the CPU build of torch, by its local version label: PyPI has only CUDA builds of that name, so
# without a CPU wheel where pip looks (this machine's find-links; elsewhere set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu) this fails at once instead of pulling GBs
TORCH=${TORCH:-torch==2.13.0+cpu}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/rlhf-dockerd.log}
WHEELS=docker/wheels
step() { printf '[docker setup %s] %s\n' "$(date +%T)" "$*"; }
t0=$(date +%s)

# 1. packages
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "docker setup: need root to install ${missing[*]}" >&2; exit 2; }
  step "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  apt-get clean   # the downloaded .debs (a few hundred MB) are not needed once installed
fi

# 2. the daemon
if ! docker info >/dev/null 2>&1; then
  step "starting dockerd (log: $DOCKERD_LOG)"
  setsid dockerd >"$DOCKERD_LOG" 2>&1 < /dev/null &
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { echo "docker setup: dockerd did not start:" >&2; tail -20 "$DOCKERD_LOG" >&2; exit 1; }
fi

# 3. the base image
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(\S*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
  mirror=${mirror:-http://deb.debian.org/debian}
  root=$(mktemp -d /tmp/rlhf-base.XXXXXX)
  step "building $BASE_IMAGE with debootstrap from $mirror (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >/dev/null
  # the machine's CA bundle: pip inside the image reaches the registry the way the host does
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import - "$BASE_IMAGE" >/dev/null
  rm -rf "$root"
fi

# 4. the wheelhouse (rebuilt when pyproject.toml, this script or $TORCH changes)
stamp=$WHEELS/.built
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ] || [ "$(cat "$stamp")" != "$TORCH" ]; then
  step "building the wheelhouse in $WHEELS"
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/*.whl
  "$PIP" wheel --quiet --wheel-dir "$WHEELS" "$TORCH" . pip "setuptools>=68" wheel 2> >(grep -v "is ignored" >&2)
  rm -f "$WHEELS"/rlhf_services-*.whl   # the project itself is built from source in the image
  echo "$TORCH" > "$stamp"
fi

# 5. the CPU image: at its peak the build holds the build stage and the runtime's copy of its
# venv at once (about 5 GB with the base image and the wheelhouse); say so before Docker's "no space
# left on device"
free_gib=$(df -Pk "$(docker info -f '{{.DockerRootDir}}')" | awk 'NR==2 {printf "%.1f", $4 / 1048576}')
if awk -v f="$free_gib" 'BEGIN {exit !(f < 5)}'; then
  echo "docker setup: WARNING: $free_gib GiB free where Docker keeps its images; building $IMAGE needs about 5 GiB" >&2
fi
step "building $IMAGE"
docker build --quiet -t "$IMAGE" --build-arg FLAVOUR=cpu --build-arg BASE_IMAGE="$BASE_IMAGE" . >/dev/null
if [ "${PRUNE:-0}" = 1 ]; then
  docker image prune -f >/dev/null
  rm -f "$WHEELS"/*.whl "$stamp"
fi
step "ready: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%s %.2f GB", "'"$IMAGE"'", $1/1e9}') in $(( $(date +%s) - t0 )) s"
