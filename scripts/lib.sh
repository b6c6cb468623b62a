# Shared by scripts/demo and scripts/test (sourced, not run).
#
# ensure_venv TARGET IMPORTS: makes ./.venv (python3 -m venv) if missing and
# runs `pip install -e TARGET` when the IMPORTS do not work from this checkout
# or pyproject.toml changed since the last install. Needs Python >= 3.11
# (set PYTHON to pick the interpreter).

ensure_venv() {
  local target="$1" imports="$2"
  local python="${PYTHON:-python3}"
  if [[ ! -x .venv/bin/python ]]; then
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      echo "ckpt needs Python >= 3.11; $python is $("$python" --version 2>&1)." \
           "Set PYTHON=/path/to/python3.11." >&2
      return 1
    fi
    echo "creating .venv with $("$python" --version 2>&1)" >&2
    "$python" -m venv .venv
  fi
  local stamp=".venv/.ckpt-install-${target//[^a-z]/_}"
  local want
  want="$(cat pyproject.toml | cksum)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] &&
     .venv/bin/python -c "
import pathlib, ckpt, ${imports}
assert pathlib.Path(ckpt.__file__).resolve().parent == pathlib.Path('ckpt').resolve()
" >/dev/null 2>&1; then
    return 0
  fi
  echo "installing ckpt and its dependencies into .venv (pip install -e '$target')" >&2
  local log=".venv/pip-install.log"
  if ! .venv/bin/python -m pip install -q -e "$target" >"$log" 2>&1; then
    cat "$log" >&2
    echo "pip install -e '$target' failed (log above, also in $log)" >&2
    return 1
  fi
  echo "$want" >"$stamp"
}
