#!/usr/bin/env bash
# A local three-node RabbitMQ cluster on 127.0.0.1 (quorum queues need a cluster), for the fault
# matrix, the benchmark and trying the product as it runs in production.
#
#   deploy/local/cluster.sh start           start the three nodes (join them on first start)
#   deploy/local/cluster.sh stop [N]        stop every node, or node N (1-3), gracefully
#   deploy/local/cluster.sh kill N          kill -9 node N (its Erlang VM and helpers)
#   deploy/local/cluster.sh freeze N|thaw N SIGSTOP / SIGCONT node N (a hung node)
#   deploy/local/cluster.sh start-node N    start node N again (after stop or kill)
#   deploy/local/cluster.sh status          what runs, where, and the cluster's view of itself
#   deploy/local/cluster.sh env             OUTBOX_AMQP_URL with the three hosts, for failover;
#                                           OUTBOX_STREAM_URL (node 1) and each node's stream URL
#   deploy/local/cluster.sh ctl N ARGS…     rabbitmqctl against node N
#   deploy/local/cluster.sh leader QUEUE    the node that leads a quorum queue now (its number)
#
# Node N listens for AMQP on $OUTBOX_CLUSTER_PORT + N - 1 (default 5691-5693), its Erlang
# distribution port is that + 20000, its name outbox-cN-<port>@localhost. The stream plugin
# (rabbitmq_stream) is on: node N takes stream protocol clients on $OUTBOX_CLUSTER_STREAM_PORT
# + N - 1 (default the AMQP base port - 1000: 4691-4693; the tests' 4791-4793, the fault
# matrix's 4781-4783; AMQP - 120, as services.sh has it, would put the tests' cluster on 5671-5673,
# the AMQPS port and the local broker's) and advertises 127.0.0.1 and that port, so that a client
# told "node N leads this stream" finds it. Stream replicas copy each other over osiris's own
# TCP ports (6000-6500 by default, each node takes free ones). Data, logs, pid files
# and each node's HOME (one shared Erlang cookie) live under $OUTBOX_LOCAL_DIR/cluster-<base port>:
# one directory per base port, so a cluster of another port (the tests' 5791, the benchmark's
# 5691) never starts from a configuration written for the other (it listened on the wrong ports).
# OUTBOX_CLUSTER_PARTITION_HANDLING (ignore, RabbitMQ's default; or pause_minority) is written
# into each node's configuration on its first start.
# RabbitMQ 3.10 does not show a node's name on its command line: the pid files are the record
# of what this script started, and only those processes are ever signalled.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
LOCAL_DIR=${OUTBOX_LOCAL_DIR:-$repo/.local}
BASE_PORT=${OUTBOX_CLUSTER_PORT:-5691}
STREAM_BASE=${OUTBOX_CLUSTER_STREAM_PORT:-$((BASE_PORT - 1000))}
DIR=$LOCAL_DIR/cluster-$BASE_PORT
RMQ_BIN=/usr/lib/rabbitmq/bin
NODES=(1 2 3)

log() { printf '[cluster] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

ensure_packages() {
  [ -x "$RMQ_BIN/rabbitmq-server" ] && return
  log "installing Debian packages: rabbitmq-server"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
}

port_of() { echo $((BASE_PORT + $1 - 1)); }
stream_port_of() { echo $((STREAM_BASE + $1 - 1)); }
name_of() { echo "outbox-c$1-$(port_of "$1")@localhost"; }
pid_file() { echo "$DIR/n$1/rabbitmq.pid"; }

cookie() {  # one cookie for the three nodes and the CLI, made once
  mkdir -p "$DIR"
  [ -f "$DIR/cookie" ] || { head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$DIR/cookie"; chmod 400 "$DIR/cookie"; }
  cat "$DIR/cookie"
}

node_env() {  # the environment of node $1 (and of rabbitmqctl talking to it)
  local n=$1 port; port=$(port_of "$n")
  local d=$DIR/n$n
  export HOME=$d/home
  export RABBITMQ_MNESIA_BASE=$d/mnesia RABBITMQ_LOG_BASE=$d/log RABBITMQ_PID_FILE=$d/rabbitmq.pid
  export RABBITMQ_NODENAME; RABBITMQ_NODENAME=$(name_of "$n")
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT=$port
  export RABBITMQ_DIST_PORT=$((port + 20000))
  export RABBITMQ_CONFIG_FILE=$d/rabbitmq RABBITMQ_ENABLED_PLUGINS_FILE=$d/enabled_plugins
  export ERL_EPMD_ADDRESS=127.0.0.1 ERL_CRASH_DUMP=$d/log/erl_crash.dump
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
  mkdir -p "$HOME" "$RABBITMQ_MNESIA_BASE" "$RABBITMQ_LOG_BASE"
  local c; c=$(cookie)
  if [ ! -f "$HOME/.erlang.cookie" ] || [ "$(cat "$HOME/.erlang.cookie")" != "$c" ]; then
    rm -f "$HOME/.erlang.cookie"; printf '%s' "$c" >"$HOME/.erlang.cookie"; chmod 400 "$HOME/.erlang.cookie"
  fi
}

ctl() { local n=$1; shift; (node_env "$n"; "$RMQ_BIN/rabbitmqctl" -q -n "$(name_of "$n")" "$@"); }

alive() { ctl "$1" status >/dev/null 2>&1; }

pid_alive() { local f; f=$(pid_file "$1"); [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; }

start_node() {
  local n=$1
  if alive "$n"; then log "node $n already running on 127.0.0.1:$(port_of "$n")"; return; fi
  (
    node_env "$n"
    [ -f "$DIR/n$n/rabbitmq.conf" ] || cat >"$DIR/n$n/rabbitmq.conf" <<CONF
listeners.tcp.default = 127.0.0.1:$(port_of "$n")
loopback_users.guest = true
# RabbitMQ's default is ignore: a node cut off from its peers keeps serving clients, and a
# quorum queue without a majority takes publishes it cannot confirm (the hard case for a
# publisher). pause_minority makes such a node close its connections instead.
cluster_partition_handling = ${OUTBOX_CLUSTER_PARTITION_HANDLING:-ignore}
CONF
    # the stream listener and the address clients are sent to for this node's streams (a
    # configuration written before streams were added gets them too)
    local sp; sp=$(stream_port_of "$n")
    grep -q '^stream.listeners' "$DIR/n$n/rabbitmq.conf" || cat >>"$DIR/n$n/rabbitmq.conf" <<CONF
stream.listeners.tcp.default = 127.0.0.1:$sp
stream.advertised_host = 127.0.0.1
stream.advertised_port = $sp
CONF
    echo '[rabbitmq_stream].' >"$RABBITMQ_ENABLED_PLUGINS_FILE"  # at every start, as services.sh
    log "starting node $n ($(name_of "$n")) on 127.0.0.1:$(port_of "$n")"
    "$RMQ_BIN/rabbitmq-server" -detached
  )
}

wait_node() {
  local n=$1 port i
  ctl "$n" wait --timeout 90 "$(pid_file "$n")" >/dev/null
  ctl "$n" await_startup --timeout 90 >/dev/null
  for port in "$(port_of "$n")" "$(stream_port_of "$n")"; do
    for i in $(seq 1 60); do  # booted is not listening: check the AMQP and stream ports
      (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && continue 2
      sleep 0.5
    done
    log "node $n booted but takes no connection on 127.0.0.1:$port"; return 1
  done
}

joined() {  # is node $1 a running member of the cluster node 1 sees?
  ctl 1 cluster_status --formatter json 2>/dev/null | grep -q "\"$(name_of "$1")\""
}

start() {
  ensure_packages
  # all three at once: a node that was clustered waits for its peers at boot
  for n in "${NODES[@]}"; do start_node "$n"; done
  for n in "${NODES[@]}"; do wait_node "$n"; done
  for n in 2 3; do
    if ! joined "$n"; then
      log "joining node $n to node 1"
      ctl "$n" stop_app >/dev/null
      ctl "$n" join_cluster "$(name_of 1)" >/dev/null 2>&1
      ctl "$n" start_app >/dev/null
    fi
  done
  for n in "${NODES[@]}"; do
    log "node $n ready: 127.0.0.1:$(port_of "$n"), streams :$(stream_port_of "$n") (pid $(cat "$(pid_file "$n")"))"
  done
}

stop_node() {
  local n=$1 f; f=$(pid_file "$n")
  [ -f "$f" ] || { log "node $n: not started by this script"; return; }
  if pid_alive "$n"; then
    log "stopping node $n (pid $(cat "$f"))"
    kill -CONT "$(cat "$f")" 2>/dev/null || true  # a frozen node cannot stop
    ctl "$n" stop "$f" >/dev/null 2>&1 || kill "$(cat "$f")" 2>/dev/null || true
  fi
  rm -f "$f"
}

kill_node() {  # kill -9 of the node's VM and of the helpers it started (erl_child_setup, inet_gethost)
  local n=$1 f pid all; f=$(pid_file "$n")
  pid_alive "$n" || { log "node $n is not running"; return 1; }
  pid=$(cat "$f")
  all="$(pgrep -P "$pid" | tr '\n' ' ')$pid"
  log "kill -9 of node $n ($all)"
  # shellcheck disable=SC2086
  kill -9 $all 2>/dev/null || true
  while [ -d "/proc/$pid" ] && ! grep -q '^State:.Z' "/proc/$pid/status" 2>/dev/null; do sleep 0.05; done
  rm -f "$f"
}

signal_node() {
  local n=$1 sig=$2
  pid_alive "$n" || { log "node $n is not running"; return 1; }
  log "SIG$sig to node $n (pid $(cat "$(pid_file "$n")"))"
  kill "-$sig" "$(cat "$(pid_file "$n")")"
}

status() {
  for n in "${NODES[@]}"; do
    if alive "$n"; then echo "node $n: running  127.0.0.1:$(port_of "$n"), streams :$(stream_port_of "$n") ($(name_of "$n"), pid $(cat "$(pid_file "$n")"))"
    elif pid_alive "$n"; then echo "node $n: not answering (pid $(cat "$(pid_file "$n")"), frozen or starting)"
    else echo "node $n: stopped"; fi
  done
}

print_env() {
  local hosts="" n
  for n in "${NODES[@]}"; do hosts+="${hosts:+,}127.0.0.1:$(port_of "$n")"; done
  echo "export OUTBOX_AMQP_URL=amqp://guest:guest@$hosts/"
  # one node is enough for a stream client: it asks that node where each stream's leader and
  # replicas are (their advertised addresses) and connects there
  echo "export OUTBOX_STREAM_URL=rabbitmq-stream://guest:guest@127.0.0.1:$(stream_port_of 1)/"
  for n in "${NODES[@]}"; do echo "export OUTBOX_CLUSTER_NODE_$n=$(name_of "$n")"; done
  for n in "${NODES[@]}"; do
    echo "export OUTBOX_CLUSTER_STREAM_URL_$n=rabbitmq-stream://guest:guest@127.0.0.1:$(stream_port_of "$n")/"
  done
}

leader() {  # the number of the node that leads quorum queue (or stream) $1 now (asks the first live node)
  local q=$1 n out
  for n in "${NODES[@]}"; do
    alive "$n" || continue
    out=$(ctl "$n" list_queues name leader --formatter json 2>/dev/null) || continue
    for m in "${NODES[@]}"; do
      if printf '%s' "$out" | grep -q "\"name\":\"$q\",\"leader\":\"$(name_of "$m")\""; then echo "$m"; return; fi
    done
  done
  return 1
}

need_n() { case ${1:-} in 1|2|3) ;; *) echo "node number 1, 2 or 3 expected" >&2; exit 2;; esac; }

case "${1:-}" in
  start) start ;;
  start-node) need_n "${2:-}"; start_node "$2"; wait_node "$2" ;;
  stop) if [ -n "${2:-}" ]; then need_n "$2"; stop_node "$2"; else for n in 3 2 1; do stop_node "$n"; done; fi ;;
  kill) need_n "${2:-}"; kill_node "$2" ;;
  freeze) need_n "${2:-}"; signal_node "$2" STOP ;;
  thaw) need_n "${2:-}"; signal_node "$2" CONT ;;
  status) status ;;
  env) print_env ;;
  ctl) need_n "${2:-}"; n=$2; shift 2; ctl "$n" "$@" ;;
  leader) [ -n "${2:-}" ] || { echo "usage: $0 leader QUEUE" >&2; exit 2; }; leader "$2" ;;
  *) echo "usage: $0 start | start-node N | stop [N] | kill N | freeze N | thaw N | status | env | ctl N ARGS… | leader QUEUE" >&2; exit 2 ;;
esac
