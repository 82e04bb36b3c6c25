#!/usr/bin/env bash
# PySpark 4 needs Java 17 or newer. Use the one on PATH when it is new enough, else install Debian's.
set -euo pipefail
major() { java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print v[1]; exit}'; }
if command -v java >/dev/null 2>&1 && [ "$(major)" -ge 17 ] 2>/dev/null; then exit 0; fi
echo "[java] installing a Java runtime (openjdk-17-jre-headless) for Spark" >&2
sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
sudo_ env DEBIAN_FRONTEND=noninteractive apt-get update -qq
sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
