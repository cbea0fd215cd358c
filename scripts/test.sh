#!/usr/bin/env bash
# test.sh: set up everything (scripts/setup.sh), then run the whole test
# suite: vet, and every package's tests with the race detector. Run as
# root: the tests of the strict subprocess level need it, and in CI
# (CI=true) no test may skip for want of root or of a level.
#
# The order, and why:
#   1. go vet and the race build of every package's test binary, side by
#      side and before any test runs: both are compiles, and under
#      `go test -p 1` each package would be compiled and linked on one core
#      between two packages' runs. No test measures a time while they load
#      the cores.
#   2. The test binaries, each in its package's directory as go test runs
#      them (-test.count=1, -test.timeout 45m), one package at a time; or,
#      with MOAT_TEST_LANES=2, in two lanes of packages run one at a time:
#      the microvm level's tests, then packages that mostly wait (LANE_VM,
#      below), beside the rest. Under `go test -p 1`
#      the microvm tests left about half a core idle for 9 minutes and the
#      waiting packages their share of both.
#   3. The README's session example at every level.
#
# Environment: MOAT_TEST_LANES=2 runs the two lanes of step 2 side by side
# (a few minutes faster here, but its time bounds have not yet been checked
# on a quiet machine: some microvm and server tests wait against a clock);
# the default, 1, runs every package in one lane, one at a time, as
# `go test -p 1` did.
set -euo pipefail
cd "$(dirname "$0")/.."
# Go as the machine ships it, where it is not on PATH yet.
[ -x /usr/local/go/bin/go ] && export PATH="$PATH:/usr/local/go/bin"
bash scripts/setup.sh

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/bin" "$work/out"
log=/tmp/moat-test.log
: >"$log"
say() { printf 'test: %s\n' "$*" | tee -a "$log"; }
elapsed() { printf '%d s' $((SECONDS - $1)); }

t0=$SECONDS
say "go vet ./..., beside the race build of the test binaries"
go vet ./... >"$work/vet.log" 2>&1 &
vet=$!
mapfile -t pkgs < <(go list ./...)
# One go command compiles every package (so none twice), then each test
# binary is linked into a file of its own (the names of packages repeat:
# moat and cmd/moat, agent and microvm/agent).
build() { "$@" >"$work/build.log" 2>&1 || { tee -a "$log" <"$work/build.log"; say "the build failed: $*"; exit 1; }; }
build go test -race -c -o /dev/null ./...
name() { printf '%s' "${1#github.com/moatsandbox/}" | tr / _; }
for p in "${pkgs[@]}"; do
	build go test -race -c -o "$work/bin/$(name "$p").test" "$p"
done
if ! wait "$vet"; then
	cat "$work/vet.log" >&2
	say "go vet failed"
	exit 1
fi
cat "$work/vet.log"
say "vet and build took $(elapsed "$t0")"

# runpkg PKG runs PKG's test binary in PKG's directory and prints go test's
# line for it; the output of a failed package goes to $work/out/NAME.
runpkg() {
	local p=$1 n bin dir start rc=0
	n=$(name "$p")
	bin=$work/bin/$n.test
	if [ ! -e "$bin" ]; then
		printf '?   \t%s\t[no test files]\n' "$p" | tee -a "$log"
		return 0
	fi
	dir=$(go list -f '{{.Dir}}' "$p")
	start=$(date +%s.%N)
	(cd "$dir" && exec "$bin" -test.paniconexit0 -test.count=1 -test.timeout=45m) >"$work/out/$n" 2>&1 || rc=$?
	local secs
	secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.3f", e-s}')
	if [ "$rc" = 0 ]; then
		printf 'ok  \t%s\t%ss\n' "$p" "$secs" | tee -a "$log"
		rm -f "$work/out/$n"
	else
		printf 'FAIL\t%s\t%ss\n' "$p" "$secs" | tee -a "$log"
		mv "$work/out/$n" "$work/out/$n.failed"
	fi
	return "$rc"
}

# lane PKG... runs the packages one after the other, on to the end even
# when one fails; it fails if any did.
lane() {
	local rc=0 p
	for p in "$@"; do runpkg "$p" || rc=1; done
	return "$rc"
}

# LANE_VM, in this order: the microvm level's tests, which keep about 1.5
# of the 2 cores busy on average (TCG: each running guest keeps a host CPU
# busy), then packages that mostly wait (user+sys of the test and its
# children at most a third of its wall time, measured with bash's time:
# e2b 0.3 cores, mcpserver, attack, bench, sandboxtest, internal/engine,
# microvm's agent and wire). The other lane runs the rest in go list's
# order; both lanes take about the same time.
LANE_VM=(microvm e2b mcpserver attack bench sandboxtest internal/engine microvm/agent microvm/internal/wire)
vm=() rest=()
if [ "${MOAT_TEST_LANES:-1}" = 1 ]; then
	rest=("${pkgs[@]}")
else
	for short in "${LANE_VM[@]}"; do
		for p in "${pkgs[@]}"; do
			if [ "$p" = "github.com/moatsandbox/moat/$short" ]; then vm+=("$p"); fi
		done
	done
	for p in "${pkgs[@]}"; do
		if ! printf '%s\n' "${vm[@]}" | grep -qxF -- "$p"; then rest+=("$p"); fi
	done
fi

t1=$SECONDS
say "go test -race: ${#vm[@]} packages in one lane, ${#rest[@]} in the other"
fail=0
lane "${vm[@]}" &
lanevm=$!
lane "${rest[@]}" || fail=1
wait "$lanevm" || fail=1
for f in "$work"/out/*.failed; do
	[ -e "$f" ] || continue
	say "output of ${f##*/}"
	tee -a "$log" <"$f"
done
say "the tests took $(elapsed "$t1")"
[ "$fail" = 0 ] || { say "FAIL"; exit 1; }

# The README's session example, unchanged but for the level, at every level
# (readme-sessions.sh builds bin/moat itself).
for level in subprocess container gvisor microvm; do
	bash scripts/readme-sessions.sh "$level" >/dev/null
	say "the README's session example ran at $level"
done
say "all in $(elapsed "$t0")"
