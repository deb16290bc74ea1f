#!/usr/bin/env bash
# What rendering notebooks needs, idempotent: nbconvert (HTML pages with JupyterLab's stylesheet)
# and Playwright's driver in the notebook venv, and Debian's Chromium (Playwright downloads no
# browser: it drives /usr/bin/chromium).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
bash "$TREETRAIN_ROOT/scripts/setup-notebooks.sh"
venv=$TREETRAIN_DEPS/venv
if ! "$venv/bin/python" -c "import nbconvert, playwright" 2>/dev/null; then
    note "installing nbconvert $NBCONVERT_VERSION and playwright $PLAYWRIGHT_VERSION into $venv"
    "$venv/bin/python" -m pip install --quiet "nbconvert==$NBCONVERT_VERSION" "playwright==$PLAYWRIGHT_VERSION" \
        || die "pip could not install nbconvert and playwright from PyPI"
fi
if [ ! -x /usr/bin/chromium ]; then
    command -v apt-get >/dev/null 2>&1 || die "no /usr/bin/chromium and no apt-get: install Chromium"
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    note "installing Debian's chromium (headless screenshots of the rendered notebooks)"
    $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq chromium fonts-dejavu-core >/dev/null \
        || die "apt-get could not install chromium"
fi
