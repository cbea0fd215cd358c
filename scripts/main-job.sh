#!/usr/bin/env bash
# main-job.sh: set up everything (scripts/setup.sh), then run moat's main
# job: the attack scoreboard and the latency table for every level available
# here (the egress probes with a network policy in force), plus the tutorial
# baseline as an ordinary user, for comparison, and the egress proxy's cost.
set -euo pipefail
cd "$(dirname "$0")/.."
# Go as the machine ships it, where it is not on PATH yet.
[ -x /usr/local/go/bin/go ] && export PATH="$PATH:/usr/local/go/bin"
bash scripts/setup.sh
moat=$PWD/bin/moat

echo
echo "== moat doctor"
"$moat" doctor

echo
echo "== attack scoreboard, every available level, default hardening"
status=0
"$moat" attack || status=$?

echo
echo "== attack scoreboard, subprocess with --hardening=tutorial, as an ordinary user"
# The tutorial's baseline: plain rlimits, run by a normal user whose home
# holds the planted credentials.
id moat-demo >/dev/null 2>&1 || useradd --create-home --shell /usr/sbin/nologin moat-demo
demo_bin=$(mktemp -d /tmp/moat-demo.XXXXXX)
install -m 0755 "$moat" "$demo_bin/moat"
chmod 0755 "$demo_bin"
( cd / && setpriv --reuid=moat-demo --regid=moat-demo --init-groups \
	env -i PATH=/usr/bin:/bin HOME=/home/moat-demo "$demo_bin/moat" attack --levels subprocess --hardening tutorial ) || true
rm -rf "$demo_bin"

echo
echo "== latency, print(1), every available level; then 8 clients for 5 s at each; both also as a page"
"$moat" bench --html bench.html --duration 5s || status=$?
echo "(the page: $(pwd)/bench.html, self-contained: open it in any browser)"

echo
echo "== the egress proxy: a fetch over loopback, direct and through the proxy"
"$moat" bench --egress 200 || status=$?
exit $status
