#!/bin/bash
# Runs the README's session example, unchanged but for the level (default
# microvm), against a fresh `moat serve` on a free loopback port, and checks
# what it prints. Usage: scripts/readme-sessions.sh [LEVEL]
set -euo pipefail
cd "$(dirname "$0")/.."
level=${1:-microvm}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "alice $(head -c 24 /dev/urandom | base64)" > "$dir/tokens"
chmod 600 "$dir/tokens"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
block=$(awk '/^A session at any level/{f=1} f&&/^```sh/{g=1;next} g&&/^```/{exit} g' README.md)
cli=$(awk '/^The same from the shell, against that server/{f=1} f&&/^```sh/{g=1;next} g&&/^```/{exit} g' README.md)
[ -n "$block" ] && [ -n "$cli" ] || { echo "readme-sessions: the README's session blocks are not found" >&2; exit 1; }
block+=$'\n'"$cli"
block=${block//--level microvm/--level $level --state-dir $dir/state}
block=${block//127.0.0.1:8080/127.0.0.1:$port}
block=${block//tokens-file tokens/tokens-file $dir/tokens}
block=${block//\$(cut -d\' \' -f2 tokens)/\$(cut -d\' \' -f2 $dir/tokens)}
go build -o bin/moat ./cmd/moat # always: a stale binary may lack a command the README uses
# The server's log goes to err; a server that did not start ends the wait.
block=${block//'; do sleep 0.2; done'/'; do kill -0 %1 || exit 1; sleep 0.2; done'}
# The server the block starts in the background goes when the block ends.
block+=$'\nkill %1; wait'
out=$(timeout 600 bash -euo pipefail -c "$block" 2>"$dir/err") || { cat "$dir/err" >&2; echo "$out"; exit 1; }
echo "$out"
grep -q '"stdout":"2\\n"' <<<"$out" && grep -q '"stdout":"1,2\\n"' <<<"$out" && grep -q '"name":"data.csv"' <<<"$out" &&
	[ "$(grep -cx '42\|41' <<<"$out")" = 2 ] ||
	{ echo "readme-sessions: unexpected output at $level" >&2; cat "$dir/err" >&2; exit 1; }
echo "readme-sessions: the README's session example ran unchanged at $level"
