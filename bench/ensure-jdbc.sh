#!/usr/bin/env bash
# Spark's JDBC baseline needs PostgreSQL's JDBC driver: Debian's libpostgresql-jdbc-java.
set -euo pipefail
jar=${BENCH_JDBC_JAR:-/usr/share/java/postgresql.jar}
[ -f "$jar" ] && exit 0
echo "[bench] installing libpostgresql-jdbc-java (PostgreSQL JDBC driver for the Spark baseline)" >&2
sudo_() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
sudo_ env DEBIAN_FRONTEND=noninteractive apt-get update -qq
sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libpostgresql-jdbc-java >/dev/null
[ -f "$jar" ] || { echo "[bench] $jar still missing after the install" >&2; exit 1; }
