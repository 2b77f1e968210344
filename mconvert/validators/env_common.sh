# Sourced by the *_env.sh builders. `env_begin VENV STAMP` prints the interpreter and exits when VENV is already
# built (STAMP present); otherwise it takes VENV.lock (one build at a time: concurrent test sessions share a venv),
# checks again under the lock, and leaves a fresh venv with an upgraded pip at VENV. `env_done VENV STAMP` stamps
# it and prints the interpreter path, the last line every caller reads.
env_begin() {
  local venv="$1" stamp="$2"
  if [ -f "$stamp" ] && [ -x "$venv/bin/python" ]; then
    echo "$venv/bin/python"
    exit 0
  fi
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock"
  flock 9
  if [ -f "$stamp" ] && [ -x "$venv/bin/python" ]; then
    echo "$venv/bin/python"
    exit 0
  fi
  rm -rf "$venv"
  "${PY:-python3}" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
}

env_done() {
  touch "$2"
  echo "$1/bin/python"
}
