#!/usr/bin/env bash
# Submit the example streaming job (orders_to_outbox.py) the way a cluster needs it: the
# executors' Python environment shipped as a packed virtualenv (pack-env.sh, `--archives`), and
# the database password kept out of Spark (its conf, UI and event log never hold it).
#
#   OUTBOX_DATABASE_URL=postgresql+psycopg://outbox@db.internal:5432/outbox \
#   OUTBOX_PASSWORD_FILE=/etc/outbox/pg-password \
#   deploy/spark/submit.sh MASTER SOURCE CHECKPOINT [--once]
#
# OUTBOX_DATABASE_URL: user, host and database, no password (a URL with one is refused).
# OUTBOX_PASSWORD_FILE: a file at this path on every node running the driver or an executor:
#   a Kubernetes secret mounted there (spark.kubernetes.driver.secrets.NAME=DIR and
#   spark.kubernetes.executor.secrets.NAME=DIR: SPARK_SUBMIT_EXTRA="--conf ..."), a file your
#   provisioning puts on the YARN nodes, or any local file in local mode. Unset: libpq's own
#   PGPASSFILE or ~/.pgpass on the nodes.
# DEPLOY_MODE=cluster on YARN or Kubernetes (Spark runs Python drivers in cluster mode only
#   there); client (the default) runs the driver here, with PYSPARK_DRIVER_PYTHON (a Python that
#   has the package: pip install 'outbox-sink[spark]').
# OUTBOX_ENV_ARCHIVE: an archive from pack-env.sh (packed here, once, when missing).
set -euo pipefail
master=${1:?spark master URL}; source=${2:?input path}; checkpoint=${3:?checkpoint path}
shift 3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${OUTBOX_DATABASE_URL:?set OUTBOX_DATABASE_URL to the PostgreSQL outbox (no password in it)}"
case "${OUTBOX_DATABASE_URL#*://}" in
  *:*@*) echo "OUTBOX_DATABASE_URL holds a password: Spark would show it. Put it in a file" \
              "named by OUTBOX_PASSWORD_FILE (or libpq's PGPASSFILE) instead." >&2; exit 2 ;;
esac
archive=${OUTBOX_ENV_ARCHIVE:-$here/outbox-env.tar.gz}
[ -f "$archive" ] || "$here/pack-env.sh" "$archive"
mode=${DEPLOY_MODE:-client}
if [ "$mode" = cluster ]; then driver_python=./environment/bin/python
else driver_python=${PYSPARK_DRIVER_PYTHON:-python3}; fi
env_conf=()
for name in OUTBOX_DATABASE_URL OUTBOX_PASSWORD_FILE; do
  [ -n "${!name:-}" ] || continue
  # the driver reads these (in cluster mode it runs on the cluster): names and paths, no secret
  env_conf+=(--conf "spark.yarn.appMasterEnv.$name=${!name}"
             --conf "spark.kubernetes.driverEnv.$name=${!name}")
done
# shellcheck disable=SC2086  # SPARK_SUBMIT_EXTRA holds several words on purpose
exec "${SPARK_SUBMIT:-spark-submit}" --master "$master" --deploy-mode "$mode" \
  --archives "$archive#environment" \
  --conf spark.pyspark.python=./environment/bin/python \
  --conf "spark.pyspark.driver.python=$driver_python" \
  "${env_conf[@]}" ${SPARK_SUBMIT_EXTRA:-} \
  "$here/orders_to_outbox.py" "$source" "$checkpoint" "$@"
