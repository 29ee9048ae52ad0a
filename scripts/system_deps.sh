#!/usr/bin/env bash
# Install the system programs a make target needs, when they are missing.
#
#   scripts/system_deps.sh test   redis-server, redis-cli, prometheus, promtool, systemd-analyze
#   scripts/system_deps.sh run    nothing beyond Python's venv module
#   scripts/system_deps.sh bench  redis-server (benchmarks/decision_redis.py), nginx (the peer
#                                 column of benchmarks/proxy_overhead.py; no test uses nginx),
#                                 perf (benchmarks/latency_split.py)
#   every target also: gcc and the Python headers (make native: the hot modules compiled
#   with mypyc, scripts/build_native.py)
#
# Each program comes from one Debian package (bookworm names):
#   redis-server     -> redis-server   (/usr/bin/redis-server; tests/helpers/redis_server.py)
#   redis-cli        -> redis-tools    (/usr/bin/redis-cli; the Redis Cluster tests)
#   prometheus       -> prometheus     (/usr/bin/prometheus; tests/integration/test_ops_prometheus.py)
#   promtool         -> prometheus     (/usr/bin/promtool; tests/deploy/test_deploy_static.py)
#   nginx            -> nginx-light    (/usr/sbin/nginx; make bench only)
#   perf             -> linux-perf     (/usr/bin/perf; make bench only)
#   systemd-analyze  -> systemd        (/usr/bin/systemd-analyze; tests/deploy/test_deploy_static.py)
#   python3 -m venv  -> python3-venv   (only when the Python that makes the venv lacks ensurepip)
#   gcc              -> gcc            (/usr/bin/gcc; make native)
#   Python.h         -> python3-dev    (only when the Python that makes the venv lacks its headers)
#
# Nothing missing: prints what it found and exits 0 without touching the system.
# Missing, root, apt-get present: `apt-get update` once, then
#   apt-get install -y --no-install-recommends <packages>
# Missing otherwise: exits 1 at once with the exact command to run as root.
# Services the packages ship are not started by this script (a Debian container's
# policy-rc.d usually stops them starting at install; on a full system apt starts them
# as it always does, and the tests never use them: they start their own processes on
# free loopback ports).
set -euo pipefail

target="${1:-test}"
PY="${PY:-python3}"

case "$target" in
    test) programs=(redis-server redis-cli prometheus promtool systemd-analyze gcc) ;;
    run) programs=(gcc) ;;
    bench) programs=(redis-server nginx perf gcc) ;;
    *)
        echo "system_deps: unknown target '$target' (test|run|bench)" >&2
        exit 2
        ;;
esac

package_of() {
    case "$1" in
        redis-server) echo redis-server ;;
        redis-cli) echo redis-tools ;;
        prometheus | promtool) echo prometheus ;;
        systemd-analyze) echo systemd ;;
        nginx) echo nginx-light ;;
        perf) echo linux-perf ;;
        gcc) echo gcc ;;
    esac
}

# Debian installs prometheus and promtool in /usr/bin and redis in /usr/bin; sbin
# directories are searched too, for a PATH without them.
found() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null 2>&1; }

missing=()
packages=()
add_package() {
    local p
    for p in "${packages[@]+"${packages[@]}"}"; do
        [[ "$p" == "$1" ]] && return 0
    done
    packages+=("$1")
}
for prog in "${programs[@]+"${programs[@]}"}"; do
    if ! found "$prog"; then
        missing+=("$prog")
        add_package "$(package_of "$prog")"
    fi
done
if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    missing+=("$PY -m venv")
    add_package python3-venv
fi
if ! "$PY" -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' >/dev/null 2>&1; then
    missing+=("Python.h")
    add_package python3-dev
fi

if [[ ${#packages[@]} -eq 0 ]]; then
    echo "system_deps ($target): all present${programs[0]+: ${programs[*]}}"
    exit 0
fi

cmd="apt-get update && apt-get install -y --no-install-recommends ${packages[*]}"
if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system_deps ($target): missing ${missing[*]}" >&2
    if command -v apt-get >/dev/null 2>&1; then
        echo "system_deps: not root; run this as root, then make $target again:" >&2
        echo "  sudo sh -c '$cmd'" >&2
    else
        echo "system_deps: no apt-get here; install the programs above (Debian package names: ${packages[*]})" >&2
    fi
    exit 1
fi

echo "system_deps ($target): missing ${missing[*]}; installing Debian packages: ${packages[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
still=()
for prog in "${programs[@]+"${programs[@]}"}"; do
    found "$prog" || still+=("$prog")
done
if [[ ${#still[@]} -gt 0 ]]; then
    echo "system_deps: installed ${packages[*]} but still missing: ${still[*]}" >&2
    exit 1
fi
echo "system_deps ($target): installed ${packages[*]}"
