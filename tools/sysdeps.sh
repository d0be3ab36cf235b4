#!/usr/bin/env bash
# Installs the Debian packages Trainyard's services and tests call, or names the one command to run.
# Usage: tools/sysdeps.sh run|test   (run: what `make run` needs; test: that plus what the tests call)
# Each package is checked with dpkg, not with `command -v`, so a binary left on PATH by hand does not hide a
# package that a fresh machine lacks.
set -euo pipefail
what=${1:-test}
# run: etcd for the local cluster. test: etcdctl (etcd-client) for the control-plane fault tests,
# systemd for `systemd-analyze verify` of the unit files in deploy/systemd, iproute2 (`ip`) for the tests that
# put each node in a network namespace of its own, postgresql for the scheduler's history store tests (they start
# a throwaway server of their own; the package's own cluster is not used), chromium for the web console's browser
# tests (tests/console: Playwright drives /usr/bin/chromium headless; no browser is downloaded), prometheus for
# promtool, which checks deploy/prometheus (tests/deploy; the package's own server is not used, and this script
# stops and disables it after installing the package).
run_pkgs=(etcd-server)
test_pkgs=(etcd-server etcd-client systemd iproute2 postgresql chromium prometheus)
case "$what" in
  run) pkgs=("${run_pkgs[@]}") ;;
  test) pkgs=("${test_pkgs[@]}") ;;
  *) echo "usage: $0 run|test" >&2; exit 2 ;;
esac
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} with apt-get ..."
  export DEBIAN_FRONTEND=noninteractive
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/tmp/trainyard-apt.log 2>&1; then
    echo "apt-get could not install ${missing[*]}; its output is in /tmp/trainyard-apt.log"; exit 1
  fi
  # The tests run promtool only: a Prometheus server the package's install started is stopped and disabled.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
else
  echo "Trainyard needs these Debian packages: ${missing[*]}. Install them with:"
  echo "  sudo apt-get install -y ${missing[*]}"
  exit 1
fi
