#!/bin/sh
# Run once by the postgres image on a new data directory (/docker-entrypoint-initdb.d), as its
# superuser: the outbox's roles of roles.sql, each with the password of its secret file.
set -eu
secret() { cat "/run/secrets/$1"; }
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v db="$POSTGRES_DB" \
  -v owner=outbox_owner -v owner_password="$(secret db_owner_password)" \
  -v publisher=outbox_publisher -v publisher_password="$(secret db_publisher_password)" \
  -v api=outbox_api -v api_password="$(secret db_api_password)" \
  -v writer=outbox_writer -v writer_password="$(secret db_writer_password)" \
  -f /etc/outbox/roles.sql
