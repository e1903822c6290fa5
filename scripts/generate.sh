#!/usr/bin/env bash
# Generates the tests' relay stubs from proto/relay.proto (never committed, never hand-edited):
#   tests/relay/_generated/   protobuf messages + grpcio stubs (the tests' client: another gRPC
#                             implementation than the server's)
# The server needs nothing generated: the relay is the native extension's, compiled from
# proto/relay.proto by the Rust build (crates/proto). bench/relay.py uses these stubs too.
# grpc_tools comes with the 'dev' extra (it ships protoc); without it (a server-only setup)
# there is nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."
python=".venv/bin/python"

if ! "$python" -c "import grpc_tools" 2>/dev/null; then
    exit 0
fi
out=tests/relay/_generated
mkdir -p "$out"
"$python" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" \
    --grpc_python_out="$out" proto/relay.proto
# protoc emits top-level imports (`import relay_pb2`); make them package-relative.
sed -i -E 's/^import relay_pb2 as /from . import relay_pb2 as /' "$out"/*.py
printf '"""Generated from proto/relay.proto by scripts/generate.sh; do not edit."""\n' \
    >"$out/__init__.py"
