#!/usr/bin/env bash
# Install deepinfer and its dependencies into the active Python environment (idempotent).
#   DEEPINFER_ACCELERATOR=cpu|nvidia|cuda|cuda:N|auto   default (auto): nvidia when `nvidia-smi` works, else cpu
#   DEEPINFER_TORCH_SPEC               torch requirement to install when no suitable torch (>= 2.9) is present
#                                      (default: torch==2.13.0 on cpu, torch>=2.9 on nvidia)
#   DEEPINFER_TORCH_INDEX_URL          extra package index for torch (e.g. a CPU-only wheel index)
#   DEEPINFER_NO_TEST_DEPS=1           skip the test dependencies (pytest, transformers==5.23.0)
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "error: deepinfer needs Python >= 3.11; found $("$PY" -c 'import sys; print(sys.version.split()[0])'). Activate a newer Python and rerun ./build.sh" >&2
  exit 1
fi

# The same rule as deepinfer's own reader (engine/env.py): cpu | nvidia | cuda | cuda:N | auto, any case; empty = auto
# here (the wheel choice), cpu at run time.
accel="$(printf '%s' "${DEEPINFER_ACCELERATOR:-}" | tr '[:upper:]' '[:lower:]' | tr -d '[:space:]')"
case "$accel" in
  ""|auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then accel=nvidia; else accel=cpu; fi ;;
  cpu|nvidia) ;;
  cuda|cuda:[0-9]*) accel=nvidia ;;
  *) echo "error: DEEPINFER_ACCELERATOR='${DEEPINFER_ACCELERATOR}': use one of cpu, nvidia, cuda, cuda:N, auto" >&2; exit 1 ;;
esac
no_test_deps="$(printf '%s' "${DEEPINFER_NO_TEST_DEPS:-}" | tr '[:upper:]' '[:lower:]' | tr -d '[:space:]')"
case "$no_test_deps" in
  1|true|yes|on) no_test_deps=1 ;;
  ""|0|false|no|off) no_test_deps=0 ;;
  *) echo "error: DEEPINFER_NO_TEST_DEPS='${DEEPINFER_NO_TEST_DEPS}' is not a flag; use 1 or 0" >&2; exit 1 ;;
esac

have_torch=$("$PY" - <<'PYEOF'
try:
    import torch
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    print("yes" if (major, minor) >= (2, 9) else "old")
except Exception:
    print("no")
PYEOF
)
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
if [ "$have_torch" = yes ]; then
  echo "build.sh: keeping installed torch $("$PY" -c 'import torch; print(torch.__version__)') ($accel)"
else
  if [ "$accel" = cpu ]; then spec="${DEEPINFER_TORCH_SPEC:-torch==2.13.0}"; else spec="${DEEPINFER_TORCH_SPEC:-torch>=2.9}"; fi
  echo "build.sh: installing $spec for $accel"
  if [ -n "${DEEPINFER_TORCH_INDEX_URL:-}" ]; then
    pip_install "$spec" --extra-index-url "$DEEPINFER_TORCH_INDEX_URL"
  else
    pip_install "$spec"
  fi
fi

target="."
[ "$no_test_deps" = 1 ] || target=".[test]"
pip_install -e "$target"
"$PY" -c 'import deepinfer, torch; print(f"build.sh: deepinfer {deepinfer.__version__} ready (torch {torch.__version__}, cuda={torch.cuda.is_available()})")'
