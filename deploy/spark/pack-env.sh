#!/usr/bin/env bash
# Pack the executors' Python environment for `spark-submit --archives`: the writer (spark_writer
# and the one module of app it imports) with its binary dependencies (psycopg and its libpq,
# pyarrow, pandas), and not pyspark: the cluster's Spark provides it. Spark's documented way to
# ship Python packages (https://spark.apache.org/docs/latest/api/python/user_guide/python_packaging.html).
#
#   deploy/spark/pack-env.sh [OUT]        (default: outbox-env.tar.gz)
#
# Run it on the OS and CPU architecture of the executors, with the Python minor version they
# will run (PYTHON=python3.11 by default: the archive carries compiled wheels and the interpreter).
set -euo pipefail
out=$(realpath -m "${1:-outbox-env.tar.gz}")
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m venv "$work/env"
pip=("$work/env/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" venv-pack
# the package without its service dependencies (FastAPI, SQLAlchemy, ...): executors import
# only spark_writer and app.outbox.content
"${pip[@]}" --no-deps "$repo"
"${pip[@]}" "psycopg[binary]>=3.2,<4" "pyarrow>=15,<27" "pandas>=2.2,<3"
# pyspark comes from the cluster (Spark puts it on the workers' PYTHONPATH): check the rest
"$work/env/bin/python" -c 'import psycopg, pyarrow, pandas, app.outbox.content'
"$work/env/bin/venv-pack" -q -p "$work/env" -o "$out" --force
echo "packed $(du -h "$out" | cut -f1) into $out"
