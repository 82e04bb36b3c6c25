#!/usr/bin/env bash
# A local highly available PostgreSQL on 127.0.0.1 (Patroni + etcd, two PostgreSQL 15 nodes), for
# the fault matrix's database failovers (scenarios 19) and for trying the product against a primary
# that moves.
#
#   deploy/local/pg-ha.sh start             start etcd and both nodes (bootstrap on first start),
#                                           wait for a primary and a streaming standby
#   deploy/local/pg-ha.sh stop              stop both nodes (standby first) and etcd
#   deploy/local/pg-ha.sh status            what runs, where, and Patroni's view (patronictl list)
#   deploy/local/pg-ha.sh env               OUTBOX_DATABASE_URL: a multi-host URL that follows the primary
#   deploy/local/pg-ha.sh primary           the number of the node that is primary now
#   deploy/local/pg-ha.sh switchover        planned switchover to the standby (patronictl)
#   deploy/local/pg-ha.sh kill-primary      kill -9 of the primary's node: its Patroni, its postmaster
#                                           and the postmaster's children (a host that dies: the
#                                           standby is promoted once the leader key expires, ttl)
#   deploy/local/pg-ha.sh kill-primary postgres   kill -9 of the postmaster and its children only:
#                                           Patroni stays and fails over at once (primary_start_timeout 0)
#   deploy/local/pg-ha.sh start-node N      start node N's Patroni again (after kill-primary): it
#                                           rejoins as a standby (pg_rewind when its WAL went further)
#   deploy/local/pg-ha.sh mode sync|async   Patroni's synchronous_mode on or off (waits until in effect)
#   deploy/local/pg-ha.sh pause|resume      Patroni's maintenance mode (no failover while paused)
#   deploy/local/pg-ha.sh pg-stop N|pg-start N   pg_ctl stop -m fast / start of node N's PostgreSQL
#                                           (with Patroni paused: nothing starts it again or promotes)
#   deploy/local/pg-ha.sh freeze-receiver   SIGSTOP of the standby's walreceiver and of the primary's
#                                           walsender feeding it: an asynchronous standby falls behind
#                                           (the receiver alone is not enough: the sockets' buffers,
#                                           megabytes on loopback, would carry the frozen seconds' WAL)
#   deploy/local/pg-ha.sh thaw-receiver     SIGCONT of what freeze-receiver stopped (those still alive)
#
# Ports, from one base $OUTBOX_PG_HA_PORT (default 5461; the fault matrix uses 5471):
#   PostgreSQL node N    base + N - 1           (5461, 5462)
#   Patroni REST node N  base + 1000 + N - 1    (6461, 6462)
#   etcd client, peer    base + 2000, base + 2001  (7461, 7462)
# Data, logs, pid files and the generated passwords live under $OUTBOX_LOCAL_DIR/pg-ha-<base>
# (default .local; under /var/tmp when run as root and the postgres user cannot reach it).
# PostgreSQL refuses to run as root: as root, etcd, Patroni and PostgreSQL run as the postgres user.
# The product logs in as outbox/outbox (password over 127.0.0.1) to database outbox.
# Patroni's settings (bootstrap, kept in etcd): synchronous_mode on, ttl 10 s, loop_wait 2 s,
# retry_timeout 5 s (a failover takes seconds), maximum_lag_on_failover 1 GiB (an asynchronous
# standby seconds behind is still promoted), use_pg_rewind (a killed primary rejoins as a standby).
# Pid files are the record of what this script started; only those processes (and the postmaster
# and backends of the data directories it owns) are ever signalled.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
LOCAL_DIR=${OUTBOX_LOCAL_DIR:-$repo/.local}
BASE_PORT=${OUTBOX_PG_HA_PORT:-5461}
PG_BIN=${OUTBOX_PG_BIN:-/usr/lib/postgresql/15/bin}
NODES=(1 2)
SCOPE=outbox-pg-ha-$BASE_PORT
ETCD_CLIENT=$((BASE_PORT + 2000))
ETCD_PEER=$((BASE_PORT + 2001))

log() { printf '[pg-ha] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
as_pg() {  # run as the postgres user when we are root (exec'ing: the pid is the command's)
  if [ "$(id -u)" = 0 ]; then setpriv --reuid=postgres --regid=postgres --init-groups "$@"; else "$@"; fi
}

ensure_packages() {
  local missing=()
  [ -x "$PG_BIN/postgres" ] || missing+=(postgresql-15)
  command -v patroni >/dev/null || missing+=(patroni)
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v curl >/dev/null || missing+=(curl)
  command -v jq >/dev/null || missing+=(jq)
  [ ${#missing[@]} -eq 0 ] && return
  log "installing Debian packages: ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

ha_dir() {  # as services.sh: where the postgres user can reach
  local want=$LOCAL_DIR/pg-ha-$BASE_PORT
  if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$LOCAL_DIR" 2>/dev/null; then
    want=/var/tmp/outbox-pg-ha-$(printf '%s' "$LOCAL_DIR" | md5sum | cut -c1-12)/pg-ha-$BASE_PORT
  fi
  printf '%s' "$want"
}
DIR=$(ha_dir)

pg_port() { echo $((BASE_PORT + $1 - 1)); }
rest_port() { echo $((BASE_PORT + 1000 + $1 - 1)); }
node_dir() { echo "$DIR/n$1"; }
data_dir() { echo "$DIR/n$1/data"; }
cfg() { echo "$DIR/n$1/patroni.yml"; }

secret() {  # a password made once per cluster directory
  local f=$DIR/secret-$1
  [ -f "$f" ] || { head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$f"; chmod 600 "$f"; }
  cat "$f"
}

# ---------------------------------------------------------------- processes

owned_pid() {  # the pid in pid file $1 if that process is alive and its command line holds $2
  local f=$1 pid
  [ -f "$f" ] || return 1
  pid=$(head -1 "$f")
  [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
  grep -q '^State:.Z' "/proc/$pid/status" 2>/dev/null && return 1
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2" || return 1
  echo "$pid"
}

spawn() {  # spawn PIDFILE LOGFILE CMD…: detached, as the postgres user; the pid file names CMD itself
  local pidf=$1 logf=$2; shift 2
  # shellcheck disable=SC2016
  HOME=$DIR setsid bash -c '
    pidf=$1 logf=$2; shift 2
    exec </dev/null >>"$logf" 2>&1
    if [ "$(id -u)" = 0 ]; then exec setpriv --reuid=postgres --regid=postgres --init-groups \
      sh -c '\''echo $$ >"$0"; exec "$@"'\'' "$pidf" "$@"
    else exec sh -c '\''echo $$ >"$0"; exec "$@"'\'' "$pidf" "$@"; fi' spawn "$pidf" "$logf" "$@" &
  local i
  for i in $(seq 1 100); do [ -s "$pidf" ] && return; sleep 0.05; done
  die "$* did not start (see $logf)"
}

wait_gone() {  # wait until every pid given has exited (or is a zombie not yet reaped)
  local p deadline=$((SECONDS + 30))
  for p in "$@"; do
    while [ -d "/proc/$p" ] && ! grep -q '^State:.Z' "/proc/$p/status" 2>/dev/null; do
      [ $SECONDS -lt $deadline ] || { log "pid $p still alive"; return 1; }
      sleep 0.05
    done
  done
}

etcd_pid() { owned_pid "$DIR/etcd.pid" "--data-dir $DIR/etcd"; }
patroni_pid() { owned_pid "$(node_dir "$1")/patroni.pid" "$(cfg "$1")"; }
postmaster_pid() { owned_pid "$(data_dir "$1")/postmaster.pid" "$(data_dir "$1")"; }
children() { pgrep -P "$1" | tr '\n' ' ' || true; }

child_named() {  # the child of postmaster $1 whose title holds $2 (walsender, walreceiver)
  local c
  for c in $(children "$1"); do
    tr '\0' ' ' <"/proc/$c/cmdline" 2>/dev/null | grep -qF -- "$2" && { echo "$c"; return; }
  done
  return 1
}

# ---------------------------------------------------------------- REST and etcd

rest() {  # rest N METHOD PATH [BODY]: Patroni's REST API of node N (body on stdout)
  local n=$1 method=$2 path=$3 args=()
  [ -n "${4:-}" ] && args=(-H 'Content-Type: application/json' -d "$4")
  curl -fsS -m 5 -X "$method" "${args[@]}" "http://127.0.0.1:$(rest_port "$n")$path"
}

any_rest() {  # the first node whose REST API answers: rest … on it
  local n
  for n in "${NODES[@]}"; do
    patroni_pid "$n" >/dev/null || continue
    rest "$n" "$@" 2>/dev/null && return
  done
  return 1
}

is_primary() {  # 200 from /primary: running as primary and holding the leader lock
  [ "$(curl -s -o /dev/null -m 3 -w '%{http_code}' "http://127.0.0.1:$(rest_port "$1")/primary")" = 200 ]
}

primary() {
  local n
  for n in "${NODES[@]}"; do patroni_pid "$n" >/dev/null && is_primary "$n" && { echo "$n"; return; }; done
  return 1
}

other() { [ "$1" = 1 ] && echo 2 || echo 1; }

start_etcd() {
  if etcd_pid >/dev/null; then log "etcd already running on 127.0.0.1:$ETCD_CLIENT"; return; fi
  log "starting etcd on 127.0.0.1:$ETCD_CLIENT (peer $ETCD_PEER)"
  spawn "$DIR/etcd.pid" "$DIR/etcd.log" etcd --name "$SCOPE" --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster "$SCOPE=http://127.0.0.1:$ETCD_PEER" \
    --initial-cluster-token "$SCOPE" --initial-cluster-state new
  local i
  for i in $(seq 1 100); do
    curl -fsS -m 2 "http://127.0.0.1:$ETCD_CLIENT/health" 2>/dev/null | grep -q '"health":"true"' && return
    etcd_pid >/dev/null || die "etcd exited (see $DIR/etcd.log)"
    sleep 0.2
  done
  die "etcd does not answer on 127.0.0.1:$ETCD_CLIENT (see $DIR/etcd.log)"
}

# ---------------------------------------------------------------- Patroni

write_config() {  # node $1's patroni.yml (rewritten on each start; the DCS part applies at bootstrap)
  local n=$1 d; d=$(node_dir "$n")
  cat >"$(cfg "$n")" <<YAML
scope: $SCOPE
name: n$n
restapi:
  listen: 127.0.0.1:$(rest_port "$n")
  connect_address: 127.0.0.1:$(rest_port "$n")
etcd3:
  hosts: 127.0.0.1:$ETCD_CLIENT
  protocol: http
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 2
    retry_timeout: 5
    # an asynchronous standby a few seconds behind is still promoted (default 1 MiB is not)
    maximum_lag_on_failover: 1073741824
    # a crashed primary whose Patroni lives fails over at once rather than recover in place
    primary_start_timeout: 0
    synchronous_mode: true
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        max_connections: 200
        wal_level: replica
        hot_standby: "on"
        wal_log_hints: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 512MB
        autovacuum_naptime: 15s
  initdb:
  - encoding: UTF8
  - locale: C.UTF-8
  - data-checksums
postgresql:
  listen: 127.0.0.1:$(pg_port "$n")
  connect_address: 127.0.0.1:$(pg_port "$n")
  data_dir: $d/data
  bin_dir: $PG_BIN
  pgpass: $d/pgpass
  authentication:
    superuser:
      username: postgres
      password: $(secret superuser)
    replication:
      username: replicator
      password: $(secret replicator)
  parameters:
    unix_socket_directories: $d
  pg_hba:
  - local all all trust
  - host replication replicator 127.0.0.1/32 scram-sha-256
  - host all all 127.0.0.1/32 scram-sha-256
  remove_data_directory_on_rewind_failure: true
  remove_data_directory_on_diverged_timelines: true
YAML
  chmod 600 "$(cfg "$n")"
}

start_patroni() {
  local n=$1
  if patroni_pid "$n" >/dev/null; then log "node $n already running (Patroni 127.0.0.1:$(rest_port "$n"))"; return; fi
  mkdir -p "$(node_dir "$n")"
  write_config "$n"
  own "$(node_dir "$n")"
  log "starting node $n: PostgreSQL 127.0.0.1:$(pg_port "$n"), Patroni 127.0.0.1:$(rest_port "$n")"
  spawn "$(node_dir "$n")/patroni.pid" "$(node_dir "$n")/patroni.log" patroni "$(cfg "$n")"
}

own() { [ "$(id -u)" = 0 ] && chown -R postgres: "$@" || true; }

cluster_json() { any_rest GET /cluster; }

ready() {  # every node's Patroni up, one primary, every other node streaming from it (in sync
  # mode, not paused: one of them synchronous)
  local n p row
  for n in "${NODES[@]}"; do patroni_pid "$n" >/dev/null || return 1; done
  p=$(primary) || return 1
  row=$(psql_on "$p" -tA -F ' ' -c "SELECT count(*), count(*) FILTER (WHERE sync_state = 'sync')
    FROM pg_stat_replication WHERE state = 'streaming'" 2>/dev/null) || return 1
  [ "${row% *}" = $((${#NODES[@]} - 1)) ] || return 1
  if [ "$(cluster_json | jq -r '.pause // false')" = false ] && sync_mode_on; then
    # PostgreSQL waits for it, and Patroni has recorded it (only a recorded one is promoted)
    [ "${row#* }" -ge 1 ] || return 1
    cluster_json | jq -e '[.members[] | select(.role == "sync_standby")] | length >= 1' >/dev/null || return 1
  fi
}

sync_mode_on() { [ "$(any_rest GET /config | jq -r '.synchronous_mode // false')" = true ]; }

wait_ready() {
  local what=${1:-the cluster} i
  for i in $(seq 1 ${2:-300}); do
    ready && return
    sleep 0.3
  done
  log "$what not ready: $(cluster_json 2>/dev/null || echo 'no Patroni answers')"
  return 1
}

psql_on() {  # psql_on N ARGS…: superuser psql over node N's socket
  PGOPTIONS='-c client_min_messages=warning' as_pg "$PG_BIN/psql" -X -q -h "$(node_dir "$1")" -p "$(pg_port "$1")" -U postgres -d postgres \
    -v ON_ERROR_STOP=1 "${@:2}"
}

ensure_role() {  # the outbox role and database (idempotent), on the primary
  local p; p=$(primary) || die "no primary"
  psql_on "$p" >/dev/null <<'SQL'
DO $$ BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox') THEN
    CREATE ROLE outbox LOGIN CREATEDB PASSWORD 'outbox';
  END IF;
END $$;
-- lets the role drop its throw-away databases WITH (FORCE) (the fault matrix's per-scenario ones)
GRANT pg_signal_backend TO outbox;
GRANT pg_read_all_stats TO outbox;
SELECT 'CREATE DATABASE outbox OWNER outbox' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'outbox')\gexec
SQL
}

start() {
  ensure_packages
  mkdir -p "$DIR"; own "$DIR"; chmod 700 "$DIR"
  start_etcd
  for n in "${NODES[@]}"; do start_patroni "$n"; done
  local i
  for i in $(seq 1 300); do primary >/dev/null && break; sleep 0.3; done
  primary >/dev/null || die "no primary elected (see $DIR/n*/patroni.log)"
  wait_ready
  ensure_role
  status
}

start_node() {
  local n=$1
  etcd_pid >/dev/null || die "etcd is not running: start first"
  start_patroni "$n"
  wait_ready "node $n's rejoin"
  log "node $n ready as $(is_primary "$n" && echo primary || echo standby)"
}

stop_patroni() {
  local n=$1 pid pm
  pid=$(patroni_pid "$n") || { log "node $n: not running"; return; }
  pm=$(postmaster_pid "$n" || true)
  [ -n "$pm" ] && kill -CONT "$pm" $(children "$pm") 2>/dev/null || true  # a frozen process cannot stop
  log "stopping node $n (Patroni pid $pid)"
  kill -TERM "$pid"
  wait_gone "$pid" || { kill -9 "$pid" 2>/dev/null || true; }
  if pm=$(postmaster_pid "$n"); then  # Patroni stops its PostgreSQL; or one pg-start started
    as_pg "$PG_BIN/pg_ctl" -D "$(data_dir "$n")" -m fast -w -t 60 stop >/dev/null || kill -9 "$pm" || true
  fi
}

stop() {
  local p n pid
  p=$(primary || true)
  for n in "${NODES[@]}"; do [ "$n" = "$p" ] || stop_patroni "$n"; done  # standby first: no failover
  [ -n "$p" ] && stop_patroni "$p"
  if pid=$(etcd_pid); then log "stopping etcd (pid $pid)"; kill -TERM "$pid"; wait_gone "$pid"; fi
  rm -f "$DIR/etcd.pid" "$DIR"/n*/patroni.pid "$DIR/frozen"
}

# ---------------------------------------------------------------- faults

kill_primary() {  # kill -9 of the primary's node (Patroni + PostgreSQL), or of its PostgreSQL only
  local what=${1:-node} p pm all
  p=$(primary) || die "no primary to kill"
  pm=$(postmaster_pid "$p") || die "node $p: no postmaster of $(data_dir "$p")"
  kill -STOP "$pm"  # no new backend forks between the listing and the kill
  all="$(children "$pm")$pm"
  [ "$what" = node ] && all="$(patroni_pid "$p") $all"
  log "kill -9 of node $p's $([ "$what" = node ] && echo "Patroni and PostgreSQL" || echo PostgreSQL) ($all)"
  # shellcheck disable=SC2086
  kill -9 $all 2>/dev/null || true
  # shellcheck disable=SC2086
  wait_gone $all
  echo "$p"
}

signal_receiver() {
  local sig=$1 p s pm_p pm_s r w f=$DIR/frozen
  if [ "$sig" = CONT ]; then
    [ -f "$f" ] || { log "nothing frozen"; return; }
    for r in $(cat "$f"); do
      # only what freeze-receiver stopped, if it still is a walreceiver or walsender
      tr '\0' ' ' <"/proc/$r/cmdline" 2>/dev/null | grep -qE 'walreceiver|walsender' && kill -CONT "$r"
    done
    log "SIGCONT to $(cat "$f")"; rm -f "$f"; return
  fi
  p=$(primary) || die "no primary"; s=$(other "$p")
  pm_s=$(postmaster_pid "$s") || die "node $s: no postmaster"
  pm_p=$(postmaster_pid "$p") || die "node $p: no postmaster"
  r=$(child_named "$pm_s" walreceiver) || die "node $s has no walreceiver"
  w=$(child_named "$pm_p" "walsender replicator") || die "node $p has no walsender"
  kill -STOP "$r" "$w"
  echo "$r $w" >"$DIR/frozen"
  log "SIGSTOP to node $s's walreceiver ($r) and node $p's walsender ($w)"
}

set_mode() {
  local want
  case $1 in sync) want=true ;; async) want=false ;; *) die "mode sync|async" ;; esac
  any_rest PATCH /config "{\"synchronous_mode\": $want}" >/dev/null || die "no Patroni answers"
  local p i names
  for i in $(seq 1 200); do
    p=$(primary || true)
    if [ -n "$p" ]; then
      names=$(psql_on "$p" -tAc 'SHOW synchronous_standby_names' 2>/dev/null || echo '?')
      if [ "$want" = false ] && [ -z "$names" ]; then log "synchronous_mode off: no standby waited for"; return; fi
      if [ "$want" = true ] && [ -n "$names" ] && [ "$names" != '?' ] && ready; then
        log "synchronous_mode on: synchronous_standby_names = $names"; return
      fi
    fi
    sleep 0.2
  done
  die "synchronous_mode $want not in effect after 40s"
}

set_pause() {
  local want=$1 i
  any_rest PATCH /config "{\"pause\": $want}" >/dev/null || die "no Patroni answers"
  for i in $(seq 1 100); do
    [ "$(cluster_json | jq -r '.pause // false')" = "$want" ] && { log "pause: $want"; return; }
    sleep 0.2
  done
  die "pause $want not in effect"
}

pg_stop() {
  local n=$1
  postmaster_pid "$n" >/dev/null || { log "node $n: PostgreSQL not running"; return; }
  log "pg_ctl stop -m fast of node $n's PostgreSQL"
  as_pg "$PG_BIN/pg_ctl" -D "$(data_dir "$n")" -m fast -w -t 60 stop >/dev/null
}

pg_start() {
  local n=$1
  postmaster_pid "$n" >/dev/null && { log "node $n: PostgreSQL already running"; return; }
  log "pg_ctl start of node $n's PostgreSQL"
  as_pg "$PG_BIN/pg_ctl" -D "$(data_dir "$n")" -l "$(node_dir "$n")/postgres.log" -w -t 60 start >/dev/null
}

# ---------------------------------------------------------------- reports

status() {
  local n role pid pm
  echo "etcd: $(etcd_pid >/dev/null && echo "running  127.0.0.1:$ETCD_CLIENT (pid $(etcd_pid))" || echo stopped)"
  for n in "${NODES[@]}"; do
    if pid=$(patroni_pid "$n"); then
      role=$(rest "$n" GET /patroni 2>/dev/null | jq -r '"\(.role) \(.state)"' || echo "not answering")
      pm=$(postmaster_pid "$n" || echo none)
      echo "node $n: $role  127.0.0.1:$(pg_port "$n") (Patroni pid $pid, postmaster $pm)"
    else echo "node $n: stopped"; fi
  done
  if etcd_pid >/dev/null && [ -f "$(cfg 1)" ]; then
    patronictl -c "$(cfg 1)" list 2>/dev/null || true
  fi
}

print_env() {
  local hosts="" n
  for n in "${NODES[@]}"; do hosts+="${hosts:+&}host=127.0.0.1:$(pg_port "$n")"; done
  echo "export OUTBOX_DATABASE_URL='postgresql+psycopg://outbox:outbox@/outbox?$hosts&target_session_attrs=read-write'"
}

need_n() { case ${1:-} in 1|2) ;; *) echo "node number 1 or 2 expected" >&2; exit 2;; esac; }

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) print_env ;;
  primary) primary || die "no primary" ;;
  switchover)
    p=$(primary) || die "no primary"; c=$(other "$p")
    log "switchover from node $p to node $c"
    patronictl -c "$(cfg "$p")" switchover --leader "n$p" --candidate "n$c" --force >&2
    for i in $(seq 1 150); do is_primary "$c" && break; sleep 0.2; done
    is_primary "$c" || die "node $c did not become primary"
    wait_ready "the switched-over cluster" ;;
  kill-primary) kill_primary "${2:-node}" ;;
  start-node) need_n "${2:-}"; start_node "$2" ;;
  mode) set_mode "${2:-}" ;;
  pause) set_pause true ;;
  resume) set_pause false ;;
  pg-stop) need_n "${2:-}"; pg_stop "$2" ;;
  pg-start) need_n "${2:-}"; pg_start "$2" ;;
  freeze-receiver) signal_receiver STOP ;;
  thaw-receiver) signal_receiver CONT ;;
  wait-ready) wait_ready ;;
  *) echo "usage: $0 start | stop | status | env | primary | switchover | kill-primary [postgres] | start-node N | mode sync|async | pause | resume | pg-stop N | pg-start N | freeze-receiver | thaw-receiver | wait-ready" >&2; exit 2 ;;
esac
