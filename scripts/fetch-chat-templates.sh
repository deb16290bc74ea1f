#!/usr/bin/env bash
# Real models' chat templates for the template tests, from the trl==1.16.0 wheel on PyPI
# (trl/chat_templates/*.jinja), extracted into .deps/chat_templates. Third-party files are
# fetched, never committed. Idempotent.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dest=$TREETRAIN_DEPS/chat_templates
[ -f "$dest/.trl-1.16.0" ] && exit 0
wheels=$TREETRAIN_CACHE/wheels
mkdir -p "$wheels"
if ! compgen -G "$wheels/trl-1.16.0-*.whl" >/dev/null; then
    "$PYTHON" -m pip download --quiet --no-deps -d "$wheels" "trl==1.16.0" ||
        die "pip could not download trl==1.16.0 (its chat templates are test inputs)"
fi
# A folder of this process's own, moved into place whole: another fetch at the same time
# never sees or removes a half-written one.
tmp=$dest.tmp.$$
rm -rf "$tmp" && mkdir -p "$tmp"
"$PYTHON" - "$wheels" "$tmp" <<'PY'
import glob, os, sys, zipfile
wheels, out = sys.argv[1:3]
with zipfile.ZipFile(sorted(glob.glob(os.path.join(wheels, "trl-1.16.0-*.whl")))[-1]) as z:
    for name in z.namelist():
        if name.startswith("trl/chat_templates/") and name.endswith(".jinja"):
            open(os.path.join(out, os.path.basename(name)), "wb").write(z.read(name))
PY
touch "$tmp/.trl-1.16.0"
if [ -f "$dest/.trl-1.16.0" ]; then
    rm -rf "$tmp"
else
    rm -rf "$dest" && mv "$tmp" "$dest"
fi
