#!/usr/bin/env bash
# Start, stop or inspect a local RabbitMQ and PostgreSQL bound to 127.0.0.1.
#
#   deploy/local/services.sh start    install missing Debian packages, start both, wait until ready
#   deploy/local/services.sh stop     stop exactly the processes this script started (by pid file)
#   deploy/local/services.sh status   print what runs and where
#   deploy/local/services.sh env      print the OUTBOX_* exports that point at these services
#
# Data, logs and pid files live under $OUTBOX_LOCAL_DIR (default: <repo>/.local, git-ignored).
# Ports: $OUTBOX_LOCAL_AMQP_PORT (5673), $OUTBOX_LOCAL_STREAM_PORT (the AMQP port - 120: 5553)
# and $OUTBOX_LOCAL_PG_PORT (5433), chosen apart from the standard ports so that a system-wide
# broker or database is never touched.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
LOCAL_DIR=${OUTBOX_LOCAL_DIR:-$repo/.local}
AMQP_PORT=${OUTBOX_LOCAL_AMQP_PORT:-5673}
# the stream protocol's listener (rabbitmq_stream): beside the AMQP port, apart from 5552 too
STREAM_PORT=${OUTBOX_LOCAL_STREAM_PORT:-$((AMQP_PORT - 120))}
PG_PORT=${OUTBOX_LOCAL_PG_PORT:-5433}
NODE=${OUTBOX_LOCAL_RABBIT_NODE:-outbox-$AMQP_PORT@localhost}
PG_BIN=${OUTBOX_PG_BIN:-/usr/lib/postgresql/15/bin}
RMQ_BIN=/usr/lib/rabbitmq/bin
RMQ_DIR=$LOCAL_DIR/rabbitmq

log() { printf '[services] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  log "installing Debian packages: $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_packages() {
  local missing=()
  [ -x "$RMQ_BIN/rabbitmq-server" ] || missing+=(rabbitmq-server)
  [ -x "$PG_BIN/postgres" ] || missing+=(postgresql-15)
  [ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
}

# PostgreSQL refuses to run as root: its data must sit where the postgres user can reach it.
pg_dir() {
  local want=$LOCAL_DIR/postgres
  mkdir -p "$LOCAL_DIR"
  if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$LOCAL_DIR" 2>/dev/null; then
    want=/var/tmp/outbox-local-$(printf '%s' "$LOCAL_DIR" | md5sum | cut -c1-12)/postgres
  fi
  printf '%s' "$want"
}

pg_run() {  # run a PostgreSQL binary as the postgres user when we are root
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

rmq_env() {
  export HOME=$RMQ_DIR/home
  export RABBITMQ_MNESIA_BASE=$RMQ_DIR/mnesia RABBITMQ_LOG_BASE=$RMQ_DIR/log
  export RABBITMQ_NODENAME=$NODE RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT=$AMQP_PORT
  export RABBITMQ_DIST_PORT=$((AMQP_PORT + 20000)) RABBITMQ_PID_FILE=$RMQ_DIR/rabbitmq.pid
  export RABBITMQ_CONFIG_FILE=$RMQ_DIR/rabbitmq RABBITMQ_ENABLED_PLUGINS_FILE=$RMQ_DIR/enabled_plugins
  export ERL_EPMD_ADDRESS=127.0.0.1 ERL_CRASH_DUMP=$RMQ_DIR/log/erl_crash.dump
  # the Erlang distribution port (inter-node and CLI traffic) on loopback too, not 0.0.0.0
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
  mkdir -p "$HOME" "$RMQ_DIR/log"
}

rmq_alive() { rmq_env; "$RMQ_BIN/rabbitmqctl" -q -n "$NODE" status >/dev/null 2>&1; }

start_rabbitmq() {
  rmq_env
  if rmq_alive; then log "rabbitmq already running on 127.0.0.1:$AMQP_PORT"; return; fi
  mkdir -p "$HOME" "$RABBITMQ_MNESIA_BASE" "$RABBITMQ_LOG_BASE"
  [ -f "$RMQ_DIR/rabbitmq.conf" ] || cat >"$RMQ_DIR/rabbitmq.conf" <<CONF
listeners.tcp.default = 127.0.0.1:$AMQP_PORT
loopback_users.guest = true
CONF
  # the stream plugin (stream destinations, app/streams): its listener on loopback, and the
  # address it tells clients to find a stream's leader at (else the host name)
  grep -q '^stream.listeners' "$RMQ_DIR/rabbitmq.conf" || cat >>"$RMQ_DIR/rabbitmq.conf" <<CONF
stream.listeners.tcp.default = 127.0.0.1:$STREAM_PORT
stream.advertised_host = 127.0.0.1
stream.advertised_port = $STREAM_PORT
CONF
  local plugins='[rabbitmq_stream].'
  # A TLS listener when asked (the TLS tests): OUTBOX_LOCAL_TLS_DIR holds ca.pem, server.pem and
  # server.key; clients may log in with a certificate (EXTERNAL, user = the certificate's CN).
  if [ -n "${OUTBOX_LOCAL_TLS_DIR:-}" ] && ! grep -q '^listeners.ssl' "$RMQ_DIR/rabbitmq.conf"; then
    cat >>"$RMQ_DIR/rabbitmq.conf" <<CONF
listeners.ssl.default = 127.0.0.1:${OUTBOX_LOCAL_AMQPS_PORT:-$((AMQP_PORT + 1000))}
ssl_options.cacertfile = $OUTBOX_LOCAL_TLS_DIR/ca.pem
ssl_options.certfile = $OUTBOX_LOCAL_TLS_DIR/server.pem
ssl_options.keyfile = $OUTBOX_LOCAL_TLS_DIR/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = EXTERNAL
ssl_cert_login_from = common_name
CONF
  fi
  grep -q '^listeners.ssl' "$RMQ_DIR/rabbitmq.conf" && plugins='[rabbitmq_stream,rabbitmq_auth_mechanism_ssl].'
  # written at every start: a data directory made before a plugin was added gets it too
  echo "$plugins" >"$RABBITMQ_ENABLED_PLUGINS_FILE"
  log "starting rabbitmq node $NODE on 127.0.0.1:$AMQP_PORT"
  rm -f "$RABBITMQ_PID_FILE"  # a killed node's (not running, checked above)
  "$RMQ_BIN/rabbitmq-server" -detached
  # the new node writes its pid file while rabbitmqctl may be reading it: a torn read
  # ({:garbage_in_pid_file, ...}, once in ten kill -9 and restarts in the fault matrix) is
  # read again rather than failing the start
  local tries=0
  until "$RMQ_BIN/rabbitmqctl" -q -n "$NODE" wait --timeout 60 "$RABBITMQ_PID_FILE" >/dev/null; do
    tries=$((tries + 1))
    [ "$tries" -lt 5 ] || return 1
    sleep 0.5
  done
  "$RMQ_BIN/rabbitmqctl" -q -n "$NODE" await_startup --timeout 60 >/dev/null
  log "rabbitmq ready (pid $(cat "$RABBITMQ_PID_FILE"))"
}

stop_rabbitmq() {
  rmq_env
  [ -f "$RABBITMQ_PID_FILE" ] || { log "rabbitmq: not started by this script"; return; }
  local pid; pid=$(cat "$RABBITMQ_PID_FILE")
  if kill -0 "$pid" 2>/dev/null; then
    log "stopping rabbitmq (pid $pid)"
    "$RMQ_BIN/rabbitmqctl" -q -n "$NODE" stop "$RABBITMQ_PID_FILE" >/dev/null 2>&1 || kill "$pid" || true
  fi
  rm -f "$RABBITMQ_PID_FILE"
}

pg_alive() { "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" 2>/dev/null; }

start_postgres() {
  local data; data=$(pg_dir)
  if [ -f "$data/postmaster.pid" ] && pg_alive; then
    log "postgresql already running on 127.0.0.1:$PG_PORT"; pg_ensure_role "$data"; return
  fi
  mkdir -p "$data"
  [ "$(id -u)" = 0 ] && chown postgres: "$data" && chmod 700 "$data"
  if [ ! -f "$data/PG_VERSION" ]; then
    log "initialising postgresql data in $data"
    pg_run "$PG_BIN/initdb" -D "$data" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
      -E UTF8 --locale=C.UTF-8 >/dev/null
    cat >>"$data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$data'
max_connections = 200
shared_buffers = 256MB
fsync = on
# autovacuum visits each database every 15 s, not every minute: the outbox is a queue
# (docs/operations.md, "Autovacuum"; its table settings are migration 0020's)
autovacuum_naptime = 15s
CONF
  fi
  log "starting postgresql on 127.0.0.1:$PG_PORT"
  pg_run "$PG_BIN/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 start >/dev/null
  pg_ensure_role "$data"
  log "postgresql ready (pid $(head -1 "$data/postmaster.pid"))"
}

pg_ensure_role() {  # the outbox role and database (idempotent)
  local data=$1
  pg_run "$PG_BIN/psql" -q -h "$data" -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 <<'SQL' >/dev/null
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox') THEN
    CREATE ROLE outbox LOGIN CREATEDB PASSWORD 'outbox';
  END IF;
END $$;
-- lets the role drop its throw-away test databases WITH (FORCE) even when autovacuum is in them
GRANT pg_signal_backend TO outbox;
-- lets `make soak` see autovacuum's progress on the outbox (pg_stat_progress_vacuum shows other
-- roles' work only to this role); local services only
GRANT pg_read_all_stats TO outbox;
-- lets a test create a throw-away login role with a password of its own (the Spark cluster
-- recipe's test checks that password appears nowhere in Spark's logs); local services only
ALTER ROLE outbox CREATEROLE;
SELECT 'CREATE DATABASE outbox OWNER outbox' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'outbox')\gexec
SQL
}

stop_postgres() {
  local data; data=$(pg_dir)
  [ -f "$data/postmaster.pid" ] || { log "postgresql: not started by this script"; return; }
  log "stopping postgresql (pid $(head -1 "$data/postmaster.pid"))"
  pg_run "$PG_BIN/pg_ctl" -D "$data" -m fast -w -t 60 stop >/dev/null || true
}

crash_postgres() {  # kill -9 of the postmaster and every backend at once (the fault matrix):
  # no shutdown checkpoint, WAL buffers not yet written are gone; the next start recovers
  local data; data=$(pg_dir)
  [ -f "$data/postmaster.pid" ] || { log "postgresql: not started by this script"; return 1; }
  local pid all p; pid=$(head -1 "$data/postmaster.pid")
  kill -STOP "$pid"  # no new backend forks between the listing and the kill
  all="$(pgrep -P "$pid" | tr '\n' ' ')$pid"
  log "crashing postgresql (kill -9 of $all)"
  # shellcheck disable=SC2086
  kill -9 $all 2>/dev/null || true
  local deadline=$((SECONDS + 30))
  for p in $all; do  # gone, or a zombie not yet reaped
    while [ -d "/proc/$p" ] && ! grep -q '^State:.Z' "/proc/$p/status" 2>/dev/null; do
      [ $SECONDS -lt $deadline ] || { log "postgresql: pid $p survived kill -9"; return 1; }
      sleep 0.05
    done
  done
  # stale lock files: a zombie postmaster not yet reaped would still pass their pid check
  rm -f "$data/postmaster.pid" "$data/.s.PGSQL.$PG_PORT.lock"
}

print_env() {  # OUTBOX_KEEP=1: variables already set win over the local defaults
  local amqp=amqp://guest:guest@127.0.0.1:$AMQP_PORT/
  local db=postgresql+psycopg://outbox:outbox@127.0.0.1:$PG_PORT/outbox
  if [ "${OUTBOX_KEEP:-}" = 1 ]; then amqp=${OUTBOX_AMQP_URL:-$amqp}; db=${OUTBOX_DATABASE_URL:-$db}; fi
  local stream=rabbitmq-stream://guest:guest@127.0.0.1:$STREAM_PORT/
  [ "${OUTBOX_KEEP:-}" = 1 ] && stream=${OUTBOX_STREAM_URL:-$stream}
  echo "export OUTBOX_AMQP_URL=$amqp"
  echo "export OUTBOX_STREAM_URL=$stream"
  echo "export OUTBOX_DATABASE_URL=$db"
  echo "export OUTBOX_LOCAL_RABBIT_NODE=$NODE"
}

status() {
  if rmq_alive; then echo "rabbitmq:   running  127.0.0.1:$AMQP_PORT, streams :$STREAM_PORT (node $NODE)"; else echo "rabbitmq:   stopped"; fi
  if pg_alive; then echo "postgresql: running  127.0.0.1:$PG_PORT ($(pg_dir))"; else echo "postgresql: stopped"; fi
}

what=${2:-all}
case "${1:-}" in
  start)
    ensure_packages
    case $what in all) start_rabbitmq; start_postgres;; rabbitmq) start_rabbitmq;; postgres) start_postgres;; esac ;;
  stop)
    case $what in all) stop_rabbitmq; stop_postgres;; rabbitmq) stop_rabbitmq;; postgres) stop_postgres;; esac ;;
  crash) [ "$what" = postgres ] || { echo "usage: $0 crash postgres" >&2; exit 2; }; crash_postgres ;;
  status) status ;;
  env) print_env ;;
  ctl) shift; rmq_env; exec "$RMQ_BIN/rabbitmqctl" -n "$NODE" "$@" ;;
  *) echo "usage: $0 start|stop [all|rabbitmq|postgres] | crash postgres | status | env | ctl ARGS…" >&2; exit 2 ;;
esac
