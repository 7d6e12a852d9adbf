#!/usr/bin/env bash
# Build checkov (PyPI) in its own venv, cached by version outside the repo, so that its many
# dependencies never touch the project's .venv pins. Prints the checkov executable (last line).
#
# The venv's folder is keyed by checkov's version and the Python version; $TPUJOB_CACHE/checkov/<version>
# links to the one built last. `make lint` runs it over the rendered chart (see .checkov.yaml).
set -euo pipefail

CHECKOV_VERSION="${CHECKOV_VERSION:-3.3.30}"
CHECKOV_PYTHON_VERSION="${CHECKOV_PYTHON_VERSION:-3.11}"

CACHE_ROOT="${TPUJOB_CACHE:-$HOME/.cache/tpujob}"
VENV="$CACHE_ROOT/checkov/checkov-${CHECKOV_VERSION}-py${CHECKOV_PYTHON_VERSION}"
LINK="$CACHE_ROOT/checkov/${CHECKOV_VERSION}"
log() { echo "[checkov-venv] $*" >&2; }

# shellcheck source=find_python.sh
source "$(dirname "${BASH_SOURCE[0]}")/find_python.sh"

install() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "checkov==${CHECKOV_VERSION}"
  "$VENV/bin/checkov" --version >/dev/null
}
cached_venv "$VENV" "$LINK" "${CHECKOV_PYTHON_VERSION}" "${CHECKOV_PYTHON:-}" install
echo "$LINK/bin/checkov"
