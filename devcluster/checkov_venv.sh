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

find_python() {
  local candidate
  for candidate in "${CHECKOV_PYTHON:-}" "python${CHECKOV_PYTHON_VERSION}" \
    "$HOME"/.pyenv/versions/"${CHECKOV_PYTHON_VERSION}"*/bin/python"${CHECKOV_PYTHON_VERSION}"; do
    [ -n "$candidate" ] || continue
    # pyenv's shim exists even where its version is not the selected one: ask it to run.
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == tuple(map(int, sys.argv[1].split(".")))' \
      "$CHECKOV_PYTHON_VERSION" 2>/dev/null; then
      command -v "$candidate" || echo "$candidate"
      return 0
    fi
  done
  log "no Python ${CHECKOV_PYTHON_VERSION} found (set CHECKOV_PYTHON)"
  return 1
}

if [ ! -f "$VENV/.complete" ]; then
  start=$SECONDS
  rm -rf "$VENV"
  python="$(find_python)"
  log "building $VENV with $python"
  "$python" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "checkov==${CHECKOV_VERSION}"
  "$VENV/bin/checkov" --version >/dev/null
  touch "$VENV/.complete"
  log "built in $((SECONDS - start))s ($(du -sh "$VENV" | cut -f1))"
fi
if [ "$(readlink "$LINK" 2>/dev/null)" != "$VENV" ]; then
  ln -sfn "$VENV" "$LINK.tmp" && mv -T "$LINK.tmp" "$LINK"
fi
echo "$LINK/bin/checkov"
