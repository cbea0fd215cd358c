#!/usr/bin/env bash
# test.sh: set up everything (scripts/setup.sh), then run the whole test
# suite: vet, and go test with the race detector over every package. Run as
# root: the tests of the strict subprocess level need it, and in CI
# (CI=true) no test may skip for want of root or of a level.
set -euo pipefail
cd "$(dirname "$0")/.."
# Go as the machine ships it, where it is not on PATH yet.
[ -x /usr/local/go/bin/go ] && export PATH="$PATH:/usr/local/go/bin"
bash scripts/setup.sh
echo "test: go vet ./..."
go vet ./...
echo "test: go test -race ./..."
# -p 1: the levels' suites each load the 2 cores on their own; running
# packages one at a time keeps their time bounds honest.
go test -race -p 1 -count=1 -timeout 45m ./... 2>&1 | tee /tmp/moat-test.log
# The README's session example, unchanged but for the level, at every level.
go build -o bin/moat ./cmd/moat
for level in subprocess container gvisor microvm; do
	bash scripts/readme-sessions.sh "$level" >/dev/null
	echo "test: the README's session example ran at $level"
done
