#!/usr/bin/env bash
# A three-node RabbitMQ cluster whose nodes run in network namespaces of their own, so that the
# network between them can be cut for real (a partition), for the fault matrix's scenario 20.
# Needs root (ip netns, a bridge, veth pairs).
#
#   deploy/local/netns-cluster.sh start        namespaces, bridge and veths; the three nodes,
#                                              clustered (idempotent: only what is missing)
#   deploy/local/netns-cluster.sh stop         stop the nodes; remove namespaces, veths, bridge
#   deploy/local/netns-cluster.sh status       each node: links cut or not, running, paused
#                                              (pause_minority) or stopped; the cluster's view
#   deploy/local/netns-cluster.sh cut N        partition node N from its two peers
#   deploy/local/netns-cluster.sh heal N       undo cut N
#   deploy/local/netns-cluster.sh env          OUTBOX_AMQP_URL with the three node addresses;
#                                              OUTBOX_STREAM_URL (node 1) and each node's
#   deploy/local/netns-cluster.sh ctl N ARGS…  rabbitmqctl against node N (run in its namespace)
#   deploy/local/netns-cluster.sh leader QUEUE the node that leads a quorum queue now (its number)
#
# The network, on this machine only: a bridge obxp0 in the root namespace with 10.231.7.1/24,
# and namespace obxp-nN with a veth (veth0) on that bridge at 10.231.7.1N/24. No default route,
# no forwarding: the nodes reach each other and the root namespace, nothing else. The publisher
# and the tests connect from the root namespace to 10.231.7.1N:5672.
#
# A cut is a blackhole route to each peer inside node N's namespace and one to node N inside
# each peer's: node-to-node traffic stops both ways while the root namespace still reaches
# node N, as when a rack's uplink fails but its clients are in the same rack. With
# cluster_partition_handling = pause_minority, node N notices its peers gone after about
# net_ticktime (10 s here, RabbitMQ's default is 60), stops serving (closes its client
# connections and its AMQP listener) and waits; healed, it rejoins and serves again.
#
# Each namespace has its own loopback, so each node has its own epmd (started by the node) and
# takes the usual ports 5672 (AMQP), 25672 (distribution), 4369 (epmd) and 5552 (the stream
# plugin, rabbitmq_stream) on its own address; it advertises that address and 5552 to stream
# clients, so that one told "node N leads this stream" connects to 10.231.7.1N:5552 (a cut node's
# streams are reached, or not, as its AMQP port is). Stream replicas copy each other over osiris's
# TCP ports (6000-6500), which a cut blackholes like the distribution port.
# Node N is rabbit@10.231.7.1N (long names: no /etc/hosts entry needed). The guest user may log
# in from the root namespace's address (loopback_users.guest = false): only this machine can
# reach these addresses. Data, logs, pid files and each node's HOME (one shared Erlang cookie)
# live under $OUTBOX_LOCAL_DIR/netns-cluster. The pid files are the record of what this script
# started, and only those processes, and those inside its own namespaces, are ever signalled.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
LOCAL_DIR=${OUTBOX_LOCAL_DIR:-$repo/.local}
DIR=$LOCAL_DIR/netns-cluster
RMQ_BIN=/usr/lib/rabbitmq/bin
NODES=(1 2 3)
BRIDGE=obxp0
NET=10.231.7
AMQP_PORT=5672
STREAM_PORT=5552
DIST_PORT=25672
TICKTIME=10

log() { printf '[netns-cluster] %s\n' "$*" >&2; }

ensure_root() {
  [ "$(id -u)" = 0 ] || { echo "netns-cluster.sh needs root (ip netns, bridge, veth)" >&2; exit 1; }
}

ensure_packages() {
  [ -x "$RMQ_BIN/rabbitmq-server" ] && return
  log "installing Debian packages: rabbitmq-server"
  env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
}

ns_of() { echo "obxp-n$1"; }
addr_of() { echo "$NET.1$1"; }
name_of() { echo "rabbit@$(addr_of "$1")"; }
pid_file() { echo "$DIR/n$1/rabbitmq.pid"; }
in_ns() { local n=$1; shift; ip netns exec "$(ns_of "$n")" "$@"; }
has_ns() { ip netns list | grep -qw "$(ns_of "$1")"; }
peers_of() { local m; for m in "${NODES[@]}"; do [ "$m" = "$1" ] || echo "$m"; done; }

# ---------------------------------------------------------------- the network

net_up() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "bridge $BRIDGE with $NET.1/24"
    ip link add "$BRIDGE" type bridge
    ip addr add "$NET.1/24" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
  local n ns
  for n in "${NODES[@]}"; do
    ns=$(ns_of "$n")
    has_ns "$n" || { log "namespace $ns"; ip netns add "$ns"; }
    if ! ip link show "$ns" >/dev/null 2>&1; then
      log "veth $ns (on $BRIDGE) <-> $ns/veth0 $(addr_of "$n")/24"
      ip link add "$ns" type veth peer name veth0 netns "$ns"
      ip link set "$ns" master "$BRIDGE"
      in_ns "$n" ip addr add "$(addr_of "$n")/24" dev veth0
    fi
    ip link set "$ns" up
    in_ns "$n" ip link set lo up
    in_ns "$n" ip link set veth0 up
  done
}

net_down() {
  local n
  for n in "${NODES[@]}"; do
    if has_ns "$n"; then log "removing namespace $(ns_of "$n")"; ip netns del "$(ns_of "$n")"; fi
    # the veth pair goes with its namespace; a root end left by a failed start does not
    ip link show "$(ns_of "$n")" >/dev/null 2>&1 && ip link del "$(ns_of "$n")"
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then log "removing bridge $BRIDGE"; ip link del "$BRIDGE"; fi
}

blackholes() { in_ns "$1" ip route show type blackhole 2>/dev/null | awk '{print $2}'; }

cut() {
  local n=$1 m
  for m in $(peers_of "$n"); do
    in_ns "$n" ip route replace blackhole "$(addr_of "$m")/32"
    in_ns "$m" ip route replace blackhole "$(addr_of "$n")/32"
  done
  log "node $n cut off from nodes $(peers_of "$n" | tr '\n' ' ')(root namespace still reaches it)"
}

heal() {
  local n=$1 m
  for m in $(peers_of "$n"); do
    in_ns "$n" ip route del blackhole "$(addr_of "$m")/32" 2>/dev/null || true
    in_ns "$m" ip route del blackhole "$(addr_of "$n")/32" 2>/dev/null || true
  done
  log "node $n healed"
}

# ---------------------------------------------------------------- the nodes

cookie() {  # one cookie for the three nodes and the CLI, made once
  mkdir -p "$DIR"
  [ -f "$DIR/cookie" ] || { head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$DIR/cookie"; chmod 400 "$DIR/cookie"; }
  cat "$DIR/cookie"
}

node_env() {  # the environment of node $1 (and of rabbitmqctl talking to it)
  local n=$1 d=$DIR/n$1 addr; addr=$(addr_of "$1")
  export HOME=$d/home
  export RABBITMQ_MNESIA_BASE=$d/mnesia RABBITMQ_LOG_BASE=$d/log RABBITMQ_PID_FILE=$d/rabbitmq.pid
  export RABBITMQ_USE_LONGNAME=true RABBITMQ_NODENAME; RABBITMQ_NODENAME=$(name_of "$n")
  export RABBITMQ_NODE_IP_ADDRESS=$addr RABBITMQ_NODE_PORT=$AMQP_PORT RABBITMQ_DIST_PORT=$DIST_PORT
  export RABBITMQ_CONFIG_FILE=$d/rabbitmq RABBITMQ_ENABLED_PLUGINS_FILE=$d/enabled_plugins
  export ERL_CRASH_DUMP=$d/log/erl_crash.dump
  unset ERL_EPMD_ADDRESS ERL_EPMD_PORT  # epmd on every address of the namespace, the usual port
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {${addr//./,}} -kernel net_ticktime $TICKTIME"
  export RABBITMQ_CTL_ERL_ARGS="-kernel net_ticktime $TICKTIME"
  mkdir -p "$HOME" "$RABBITMQ_MNESIA_BASE" "$RABBITMQ_LOG_BASE"
  local c; c=$(cookie)
  if [ ! -f "$HOME/.erlang.cookie" ] || [ "$(cat "$HOME/.erlang.cookie")" != "$c" ]; then
    rm -f "$HOME/.erlang.cookie"; printf '%s' "$c" >"$HOME/.erlang.cookie"; chmod 400 "$HOME/.erlang.cookie"
  fi
}

ctl() { local n=$1; shift; (node_env "$n"; in_ns "$n" "$RMQ_BIN/rabbitmqctl" -q -l -n "$(name_of "$n")" "$@"); }

pid_alive() { local f; f=$(pid_file "$1"); [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null; }

vm_answers() { has_ns "$1" && pid_alive "$1" && ctl "$1" eval 'ok.' >/dev/null 2>&1; }

app_running() {  # the rabbit application runs on node $1 (false while pause_minority holds it)
  has_ns "$1" && pid_alive "$1" && [ "$(ctl "$1" eval 'rabbit:is_running().' 2>/dev/null)" = true ]
}

amqp_open() { (exec 3<>"/dev/tcp/$(addr_of "$1")/$AMQP_PORT") 2>/dev/null; }
stream_open() { (exec 3<>"/dev/tcp/$(addr_of "$1")/$STREAM_PORT") 2>/dev/null; }

start_node() {
  local n=$1 d=$DIR/n$1
  if pid_alive "$n"; then log "node $n already running ($(name_of "$n"), pid $(cat "$(pid_file "$n")"))"; return; fi
  (
    node_env "$n"
    [ -f "$d/rabbitmq.conf" ] || cat >"$d/rabbitmq.conf" <<CONF
listeners.tcp.default = $(addr_of "$n"):$AMQP_PORT
# guest from the root namespace (10.231.7.1): these addresses exist on this machine only
loopback_users.guest = false
# a node that cannot see a majority of the cluster stops serving (closes its connections and
# its listener) until it can again: a publisher on it must move to the majority
cluster_partition_handling = pause_minority
CONF
    # the stream listener on the node's address, advertised as it (a configuration written
    # before streams were added gets them too)
    grep -q '^stream.listeners' "$d/rabbitmq.conf" || cat >>"$d/rabbitmq.conf" <<CONF
stream.listeners.tcp.default = $(addr_of "$n"):$STREAM_PORT
stream.advertised_host = $(addr_of "$n")
stream.advertised_port = $STREAM_PORT
CONF
    echo '[rabbitmq_stream].' >"$RABBITMQ_ENABLED_PLUGINS_FILE"  # at every start, as services.sh
    log "starting node $n ($(name_of "$n")) in namespace $(ns_of "$n") on $(addr_of "$n"):$AMQP_PORT"
    in_ns "$n" "$RMQ_BIN/rabbitmq-server" -detached
  )
}

wait_node() {
  local n=$1 i
  ctl "$n" wait --timeout 90 "$(pid_file "$n")" >/dev/null
  ctl "$n" await_startup --timeout 120 >/dev/null
  for i in $(seq 1 60); do  # booted is not listening: check the ports from the root namespace
    amqp_open "$n" && stream_open "$n" && return
    sleep 0.5
  done
  log "node $n booted but takes no AMQP or stream connection on $(addr_of "$n")"; return 1
}

joined() {  # is node $1 a running member of the cluster node 1 sees?
  ctl 1 cluster_status --formatter json 2>/dev/null | grep -q "\"$(name_of "$1")\""
}

start() {
  ensure_packages
  net_up
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
    log "node $n ready: $(addr_of "$n"):$AMQP_PORT, streams :$STREAM_PORT (pid $(cat "$(pid_file "$n")"))"
  done
}

stop_node() {
  local n=$1 f pid i; f=$(pid_file "$n")
  [ -f "$f" ] || return 0
  if pid_alive "$n" && has_ns "$n"; then
    pid=$(cat "$f")
    log "stopping node $n (pid $pid)"
    ctl "$n" stop "$f" >/dev/null 2>&1 || kill "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  rm -f "$f"
}

clear_ns() {  # what is left in a namespace of ours (epmd, a node that did not stop): ended
  local n=$1 pids i
  has_ns "$n" || return 0
  in_ns "$n" epmd -kill >/dev/null 2>&1 || true
  for i in $(seq 1 25); do
    pids=$(ip netns pids "$(ns_of "$n")" | tr '\n' ' ')
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    if [ "$i" -lt 20 ]; then kill $pids 2>/dev/null || true; else kill -9 $pids 2>/dev/null || true; fi
    sleep 0.2
  done
  log "namespace $(ns_of "$n") still holds processes: $(ip netns pids "$(ns_of "$n")" | tr '\n' ' ')"
}

stop() {
  local n
  for n in "${NODES[@]}"; do has_ns "$n" && heal "$n" 2>/dev/null; done
  for n in 3 2 1; do stop_node "$n"; done
  for n in "${NODES[@]}"; do clear_ns "$n"; done
  net_down
}

status() {
  local n cut state
  for n in "${NODES[@]}"; do
    if ! has_ns "$n"; then echo "node $n: no namespace (stopped)"; continue; fi
    cut=$(blackholes "$n" | tr '\n' ' ')
    if app_running "$n"; then state="running"
    elif vm_answers "$n"; then state="paused (VM up, RabbitMQ stopped: pause_minority)"
    elif pid_alive "$n"; then state="not answering (pid $(cat "$(pid_file "$n")"))"
    else state="stopped"; fi
    amqp_open "$n" && state+=", AMQP open" || state+=", AMQP closed"
    stream_open "$n" && state+=", streams open" || state+=", streams closed"
    echo "node $n: $state  $(addr_of "$n"):$AMQP_PORT ($(name_of "$n"))${cut:+  cut from: $cut}"
  done
  for n in "${NODES[@]}"; do
    app_running "$n" || continue
    ctl "$n" cluster_status --formatter json 2>/dev/null \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); print("node '"$n"' sees running:", " ".join(d.get("running_nodes", [])), "| partitions:", d.get("partitions") or "none")' \
      || true
  done
}

print_env() {
  local hosts="" n
  for n in "${NODES[@]}"; do hosts+="${hosts:+,}$(addr_of "$n"):$AMQP_PORT"; done
  echo "export OUTBOX_AMQP_URL=amqp://guest:guest@$hosts/"
  # one node is enough for a stream client: it asks where each stream's leader and replicas are
  echo "export OUTBOX_STREAM_URL=rabbitmq-stream://guest:guest@$(addr_of 1):$STREAM_PORT/"
  for n in "${NODES[@]}"; do echo "export OUTBOX_NETNS_NODE_$n=$(name_of "$n")"; done
  for n in "${NODES[@]}"; do
    echo "export OUTBOX_NETNS_STREAM_URL_$n=rabbitmq-stream://guest:guest@$(addr_of "$n"):$STREAM_PORT/"
  done
}

leader() {  # the number of the node that leads quorum queue $1 now (asks the first running node)
  local q=$1 n m out
  for n in "${NODES[@]}"; do
    app_running "$n" || continue
    out=$(ctl "$n" list_queues name leader --formatter json 2>/dev/null) || continue
    for m in "${NODES[@]}"; do
      if printf '%s' "$out" | grep -q "\"name\":\"$q\",\"leader\":\"$(name_of "$m")\""; then echo "$m"; return; fi
    done
  done
  return 1
}

need_n() { case ${1:-} in 1|2|3) ;; *) echo "node number 1, 2 or 3 expected" >&2; exit 2;; esac; }
need_ns() { has_ns "$1" || { echo "namespace $(ns_of "$1") does not exist: run start first" >&2; exit 1; }; }

case "${1:-}" in
  start) ensure_root; start ;;
  stop) ensure_root; stop ;;
  status) ensure_root; status ;;
  cut) ensure_root; need_n "${2:-}"; need_ns "$2"; cut "$2" ;;
  heal) ensure_root; need_n "${2:-}"; need_ns "$2"; heal "$2" ;;
  env) print_env ;;
  ctl) ensure_root; need_n "${2:-}"; need_ns "$2"; n=$2; shift 2; ctl "$n" "$@" ;;
  leader) ensure_root; [ -n "${2:-}" ] || { echo "usage: $0 leader QUEUE" >&2; exit 2; }; leader "$2" ;;
  *) echo "usage: $0 start | stop | status | cut N | heal N | env | ctl N ARGS… | leader QUEUE" >&2; exit 2 ;;
esac
