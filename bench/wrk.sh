#!/bin/sh
# The hop as an outside client sees it (docs/performance.md, "wrk beside the project's bench"):
# wrk, one connection, one thread, against llama-server direct, nginx in front of it, and
# 1bit serve in front of its own llama-server (and another build's serve with BASELINE=path),
# on POST /tokenize and on the README's chat, in alternating rounds. Prints wrk's latency
# percentiles per arm and round; each arm's added time is its figure minus the direct arm's.
#
#   bench/wrk.sh [ROUNDS] [SECONDS]      (3 rounds of 10 s by default)
#
# LLAMA_SERVER=path runs another engine in llama-server's place on every arm: the tests' fake
# backend (target/release/fake-backend) answers the chat at once, so serve's added time on it is
# not lost in the generation's milliseconds.
#
# Needs wrk (Debian: apt-get install wrk) and nginx (apt-get install nginx-light), the release
# build (cargo build --release -p onebit-host -p onebit-route-cpu) and setup's llama-server and
# model (cargo xtask paths).
set -eu
rounds=${1:-3}
seconds=${2:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
for tool in wrk nginx; do
    command -v "$tool" >/dev/null || command -v "/usr/sbin/$tool" >/dev/null || {
        echo "bench/wrk.sh: $tool is missing; install it (apt-get install $tool)" >&2
        exit 2
    }
done
eval "$(cd "$root" && cargo xtask paths 2>/dev/null)"
llama_server=${LLAMA_SERVER:-$llama_server}
onebit="$root/target/release/1bit"
[ -x "$onebit" ] || {
    echo "bench/wrk.sh: $onebit is missing; build it (cargo build --release -p onebit-host -p onebit-route-cpu)" >&2
    exit 2
}
scratch=$(mktemp -d /tmp/onebit-wrk.XXXXXX)
pids=""
cleanup() {
    for p in $pids; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$scratch"
}
trap cleanup EXIT INT TERM

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ready() {
    i=0
    until curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; do
        i=$((i + 1))
        [ $i -lt 600 ] || { echo "bench/wrk.sh: nothing ready on port $1" >&2; exit 1; }
        sleep 0.1
    done
}

direct=$(port)
"$llama_server" -m "$model" --host 127.0.0.1 --port "$direct" --metrics --jinja -ngl 0 -c 4096 \
    --threads-http 2 >"$scratch/direct.log" 2>&1 &
pids="$pids $!"
proxy=$(port)
mkdir -p "$scratch/nginx"
cat >"$scratch/nginx/nginx.conf" <<EOF
worker_processes auto;
pid $scratch/nginx/nginx.pid;
error_log $scratch/nginx/error.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    keepalive_requests 1000000;
    upstream backend { server 127.0.0.1:$direct; keepalive 128; keepalive_requests 1000000; }
    server {
        listen 127.0.0.1:$proxy;
        location / {
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }
    }
}
EOF
"$(command -v nginx || echo /usr/sbin/nginx)" -p "$scratch/nginx" -c "$scratch/nginx/nginx.conf" \
    -e "$scratch/nginx/error.log" -g 'daemon off;' &
pids="$pids $!"
serve=$(port)
LLAMA_ARG_THREADS_HTTP=2 "$onebit" serve -m "$model" --device cpu --host 127.0.0.1 --port "$serve" \
    --llama-server "$llama_server" >"$scratch/serve.log" 2>&1 &
pids="$pids $!"
arms="direct:$direct nginx:$proxy serve:$serve"
if [ -n "${BASELINE:-}" ]; then
    baseline=$(port)
    LLAMA_ARG_THREADS_HTTP=2 "$BASELINE" serve -m "$model" --device cpu --host 127.0.0.1 \
        --port "$baseline" --llama-server "$llama_server" >"$scratch/baseline.log" 2>&1 &
    pids="$pids $!"
    arms="$arms baseline:$baseline"
fi
for arm in $arms; do ready "${arm#*:}"; done

cat >"$scratch/tokenize.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"content":"What is the capital of France? Answer in one word."}'
EOF
cat >"$scratch/chat.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"messages":[{"role":"user","content":"What is the capital of France? Answer in one word."}],"temperature":0}'
EOF

echo "wrk -t1 -c1 -d${seconds}s, $rounds round(s); load $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-9s %-9s %-6s %10s %10s %10s %10s %9s\n' request arm round p50 p75 p90 p99 requests
for request in tokenize chat; do
    round=1
    while [ $round -le "$rounds" ]; do
        # Each round in another order, so no arm always follows the same one.
        order=$arms
        [ $((round % 2)) -eq 0 ] && order=$(echo "$arms" | tr ' ' '\n' | sort -r | tr '\n' ' ')
        for arm in $order; do
            name=${arm%%:*}
            path=/tokenize
            [ "$request" = chat ] && path=/v1/chat/completions
            wrk -t1 -c1 -d"${seconds}s" --latency -s "$scratch/$request.lua" \
                "http://127.0.0.1:${arm#*:}$path" >"$scratch/out" 2>&1
            awk -v request="$request" -v arm="$name" -v round="$round" '
                /^ +50%/ { p50 = $2 } /^ +75%/ { p75 = $2 } /^ +90%/ { p90 = $2 } /^ +99%/ { p99 = $2 }
                / requests in / { n = $1 }
                END { printf "%-9s %-9s %-6s %10s %10s %10s %10s %9s\n", request, arm, round, p50, p75, p90, p99, n }
            ' "$scratch/out"
        done
        round=$((round + 1))
    done
done
