#!/usr/bin/env bash
# Build mkdocs and mkdocs-material (PyPI) in their own venv, cached by version outside the repo, so
# that their dependencies never touch the project's .venv pins. Prints the venv's bin folder (last line).
#
# The venv's folder is keyed by both versions and the Python version; $TPUJOB_CACHE/docs/<key> links to
# the one built last. `make lint` runs "$(devcluster/docs_venv.sh)/mkdocs" build --strict (see mkdocs.yml).
set -euo pipefail

MKDOCS_VERSION="${MKDOCS_VERSION:-1.6.1}"
MKDOCS_MATERIAL_VERSION="${MKDOCS_MATERIAL_VERSION:-9.8.1}"
DOCS_PYTHON_VERSION="${DOCS_PYTHON_VERSION:-3.11}"

CACHE_ROOT="${TPUJOB_CACHE:-$HOME/.cache/tpujob}"
KEY="mkdocs-${MKDOCS_VERSION}-material-${MKDOCS_MATERIAL_VERSION}"
VENV="$CACHE_ROOT/docs/${KEY}-py${DOCS_PYTHON_VERSION}"
LINK="$CACHE_ROOT/docs/${KEY}"
log() { echo "[docs-venv] $*" >&2; }

# shellcheck source=find_python.sh
source "$(dirname "${BASH_SOURCE[0]}")/find_python.sh"

install() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "mkdocs==${MKDOCS_VERSION}" "mkdocs-material==${MKDOCS_MATERIAL_VERSION}"
  "$VENV/bin/mkdocs" --version >/dev/null
}
mkdir -p "$CACHE_ROOT/docs"
cached_venv "$VENV" "$LINK" "${DOCS_PYTHON_VERSION}" "${DOCS_PYTHON:-}" install
echo "$LINK/bin"
