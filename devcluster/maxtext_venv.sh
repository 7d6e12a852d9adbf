#!/usr/bin/env bash
# Build the MaxText venv for the devcluster's MaxText image (devcluster/images.yaml), cached by
# version outside the repo. Prints the venv's python on stdout (last line).
#
# MaxText 0.2.5 declares every dependency under extras and none in its base. Its `tpu` extra is a
# whole development environment (linters, pytype, pytest, libtpu, NVIDIA tools, ...); the devcluster
# trains on CPU, so this installs MaxText itself without dependencies and then the `tpu` extra's
# requirements, read from the wheel's own metadata, minus the TPU runtime and the development tools
# (MAXTEXT_DROP). Those requirements are lower bounds only, so every version is pinned by
# maxtext-constraints.txt: a release that reaches the registry later cannot change the venv. The venv's
# folder is keyed by MaxText's version, the Python version, the drop list and the constraints;
# $TPUJOB_CACHE/maxtext/<version> links to the one built last (devcluster/images.yaml runs it).
set -euo pipefail

MAXTEXT_VERSION="${MAXTEXT_VERSION:-0.2.5}"
MAXTEXT_PYTHON_VERSION="${MAXTEXT_PYTHON_VERSION:-3.12}"
# Requirements of maxtext[tpu] left out: the TPU runtime (the devcluster has CPUs), CUDA tools, and
# linters/type checkers/test runners that MaxText's training never imports.
MAXTEXT_DROP="libtpu nvidia-cuda-cccl nvidia-ml-py pynvml astroid auditwheel black build cfgv coverage distlib
execnet hypothesis identify importlab iniconfig isort libclang mccabe nodeenv pre-commit pycnite pyink pylint
pytest pytest-xdist pytype python-discovery scipy-stubs virtualenv"

CACHE_ROOT="${TPUJOB_CACHE:-$HOME/.cache/tpujob}"
CONSTRAINTS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/maxtext-constraints.txt"
DIGEST="$( { echo "$MAXTEXT_DROP"; cat "$CONSTRAINTS"; } | sha1sum | cut -c1-12)"
VENV="$CACHE_ROOT/maxtext/maxtext-${MAXTEXT_VERSION}-py${MAXTEXT_PYTHON_VERSION}-${DIGEST}"
LINK="$CACHE_ROOT/maxtext/${MAXTEXT_VERSION}"
log() { echo "[maxtext-venv] $*" >&2; }

# shellcheck source=find_python.sh
source "$(dirname "${BASH_SOURCE[0]}")/find_python.sh"

install() {
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip download -q --no-deps --dest "$work" "maxtext==${MAXTEXT_VERSION}"
  # The tpu extra's requirements (name and version bound, environment markers dropped), minus MAXTEXT_DROP.
  "$VENV/bin/python" - "$work"/maxtext-*.whl "$MAXTEXT_DROP" > "$work/requirements.txt" <<'PY'
import re, sys, zipfile
from email.parser import Parser

wheel, drop = sys.argv[1], set(sys.argv[2].split())
with zipfile.ZipFile(wheel) as archive:
    name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = Parser().parsestr(archive.read(name).decode())
for requirement in metadata.get_all("Requires-Dist") or []:
    spec, _, marker = requirement.partition(";")
    if "extra == 'tpu'" not in marker:
        continue
    package = re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0].lower()
    if package not in drop:
        print(spec.strip())
PY
  "$VENV/bin/python" -m pip install -q --no-deps "$work"/maxtext-*.whl
  "$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -r "$work/requirements.txt"
  "$VENV/bin/python" -c 'import maxtext.trainers.pre_train.train' >/dev/null
}
cached_venv "$VENV" "$LINK" "${MAXTEXT_PYTHON_VERSION}" "${MAXTEXT_PYTHON:-}" install
echo "$LINK/bin/python"
