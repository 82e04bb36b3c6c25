#!/usr/bin/env bash
# Submit the example streaming job to a cluster. Usage:
#   OUTBOX_DATABASE_URL=postgresql+psycopg://… deploy/spark/submit.sh spark://master:7077 SOURCE CHECKPOINT
set -euo pipefail
master=${1:?spark master URL}; source=${2:?input path}; checkpoint=${3:?checkpoint path}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
: "${OUTBOX_DATABASE_URL:?set OUTBOX_DATABASE_URL to the PostgreSQL outbox}"
zip_file=$(mktemp -d)/outbox_sink.zip
(cd "$repo" && zip -qr "$zip_file" spark_writer)
exec spark-submit --master "$master" \
  --conf "spark.executorEnv.OUTBOX_DATABASE_URL=$OUTBOX_DATABASE_URL" \
  --py-files "$zip_file" \
  "$here/orders_to_outbox.py" "$source" "$checkpoint"
