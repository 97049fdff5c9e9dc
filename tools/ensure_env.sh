#!/usr/bin/env bash
# Create ./.venv if it is missing and (re)install labkit with its dev extra when pyproject.toml
# changed. Idempotent: a second run with nothing to do takes well under a second.
#
#   LABKIT_PYTHON   interpreter to build the venv from (default: python3)
#   LABKIT_TORCH    pip requirement for torch when the venv has none yet (default: torch),
#                   e.g. "torch==2.13.0" or "torch --index-url <a CPU-only wheel index>";
#                   a venv whose torch does not satisfy it is reported (tools/check_torch.py),
#                   never silently reinstalled
set -euo pipefail
cd "$(dirname "$0")/.."
py=${LABKIT_PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "labkit needs Python >= 3.10 (found: $("$py" --version 2>&1)); set LABKIT_PYTHON" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $("$py" --version)"
  "$py" -m venv .venv
fi
want=$(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(open("pyproject.toml","rb").read()).hexdigest())')
stamp=.venv/.labkit-installed
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  # an existing torch is kept; say so when LABKIT_TORCH asks for another (it used to be ignored)
  .venv/bin/python tools/check_torch.py
  exit 0
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  # shellcheck disable=SC2086  # LABKIT_TORCH may carry pip options
  .venv/bin/python -m pip install ${LABKIT_TORCH:-torch}
fi
.venv/bin/python tools/check_torch.py
.venv/bin/python -m pip install -q -e ".[dev]"
# The kernel that notebooks, nbval and nbclient use is this venv's Python.
.venv/bin/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (labkit)" >/dev/null
# JupyterLab: start the kernel without a dialog, and no news toast over the notebook.
# windowingMode "none": every cell is laid out when a notebook opens, so a link to a section
# of an open notebook (14's index -> 13#heading=...) scrolls to it; windowed modes scroll by
# estimated heights and land thousands of pixels off. On a notebook's *first* open JupyterLab
# 4.6 still lands at the top (its markdown is not rendered when the fragment is applied; cf.
# jupyterlab/jupyterlab#15207): tests/test_browser.py checks the link and reports that case.
mkdir -p .venv/share/jupyter/lab/settings
cat > .venv/share/jupyter/lab/settings/overrides.json <<'JSON'
{
  "@jupyterlab/notebook-extension:panel": {"autoStartDefaultKernel": true},
  "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
  "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}
}
JSON
echo "$want" > "$stamp"
