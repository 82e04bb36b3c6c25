#!/usr/bin/env bash
# Tools the tests and the demo need besides Python: Java 17+ for PySpark 4, jq (the README's
# operator session pipes through it), promtool (the alert rules' tests; Debian's prometheus
# package) and chromium with chromium-driver (the web console's browser tests). Installs
# Debian's packages for whatever is missing.
set -euo pipefail
major() { java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print v[1]; exit}'; }
missing=()
if ! { command -v java >/dev/null 2>&1 && [ "$(major)" -ge 17 ] 2>/dev/null; }; then
  missing+=(openjdk-17-jre-headless)
fi
command -v jq >/dev/null 2>&1 || missing+=(jq)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
# the web console's browser tests: Debian's headless Chromium and its WebDriver
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "[tools] installing ${missing[*]}" >&2
sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
sudo_ env DEBIAN_FRONTEND=noninteractive apt-get update -qq
sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
