#!/usr/bin/env bash
# The README's two promises for a user's bare clone: `make serve` works with nothing beside the
# clone (no ../shared), and the README's curl line then gets a completion. Clones the committed
# HEAD of SOURCE_DIR into an empty folder, runs the README's serve command there, waits for the
# cluster, runs the curl command block from the README, checks the reply, stops everything.
# Bounded: SERVE_TIMEOUT seconds for build + start (ccache makes the build mostly hits).
# Usage: bare_clone_serve.sh SOURCE_DIR
set -uo pipefail
src=$(cd "$1" && pwd)
SERVE_TIMEOUT=${SERVE_TIMEOUT:-600}
work=$(mktemp -d /tmp/pdserve-bare-clone.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill -TERM -- "-$pid" 2>/dev/null; sleep 1; kill -KILL -- "-$pid" 2>/dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

git clone --quiet "$src" "$work/pdserve" || { echo "FAIL: git clone"; exit 1; }
cd "$work/pdserve"
[ ! -e ../shared ] || { echo "FAIL: $work/shared exists; the clone must stand alone"; exit 1; }

# The README's serve command, in its own process group so every child can be stopped.
serve=$(grep -m1 -o '^make serve' README.md) || { echo "FAIL: README has no 'make serve' line"; exit 1; }
setsid bash -c "$serve" > serve.log 2>&1 &
pid=$!
deadline=$(( $(date +%s) + SERVE_TIMEOUT ))
until grep -q "pdserve is up" serve.log; do
  if ! kill -0 "$pid" 2>/dev/null; then echo "FAIL: '$serve' exited:"; tail -40 serve.log; exit 1; fi
  if [ "$(date +%s)" -ge "$deadline" ]; then echo "FAIL: not up within ${SERVE_TIMEOUT}s:"; tail -40 serve.log; exit 1; fi
  sleep 2
done

# `make serve` builds the programs a cluster runs, not the tests or benchmarks.
built_tests=$(find build -type f -perm -u+x \( -name 'test_*' -o -name '*_bench' \) | head -3)
[ -z "$built_tests" ] || { echo "FAIL: make serve built tests or benchmarks: $built_tests"; exit 1; }

# The README's curl command (the first `curl` line and its continuation lines).
curl_cmd=$(awk '/^curl /{on=1} on{print; if ($0 !~ /\\$/) exit}' README.md)
[ -n "$curl_cmd" ] || { echo "FAIL: README has no curl line"; exit 1; }
reply=$(bash -c "$curl_cmd --max-time 60") || { echo "FAIL: the README's curl line failed"; exit 1; }
echo "$reply" | python3 -c '
import json, sys
data = sys.stdin.read()
if data.startswith("HTTP/"):  # the README shows the headers too (curl -i)
    head, data = data.split("\r\n\r\n", 1)
    assert " 200 " in head.splitlines()[0], head
r = json.loads(data)
text = r["choices"][0]["text"]
assert r["object"] == "text_completion" and r["usage"]["completion_tokens"] > 0, r
print("ok: a completion of %d tokens from the bare clone" % r["usage"]["completion_tokens"])
' || { echo "FAIL: not a completion: $reply"; exit 1; }
