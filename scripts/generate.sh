#!/usr/bin/env bash
# Generates the relay's Python stubs from proto/relay.proto (never committed, never hand-edited):
#   static/relay/_generated/  protobuf messages + purerpc stubs (the server)
#   tests/relay/_generated/   protobuf messages + grpcio stubs (the tests' client: another gRPC
#                             implementation than the server's)
# grpc_tools comes with the 'server' extra (it ships protoc).
set -euo pipefail
cd "$(dirname "$0")/.."
python=".venv/bin/python"

gen() {  # gen OUT_DIR PLUGIN_ARGS...
    local out="$1"
    shift
    mkdir -p "$out"
    "$python" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" "$@" proto/relay.proto
    # protoc emits top-level imports (`import relay_pb2`); make them package-relative.
    sed -i -E 's/^import relay_pb2 as /from . import relay_pb2 as /' "$out"/*.py
    printf '"""Generated from proto/relay.proto by scripts/generate.sh; do not edit."""\n' \
        >"$out/__init__.py"
}

if ! "$python" -c "import grpc_tools" 2>/dev/null; then
    echo "generate: grpcio-tools is missing (pip install -e '.[server]')" >&2
    exit 1
fi
gen static/relay/_generated --purerpc_out=static/relay/_generated \
    --plugin=protoc-gen-purerpc=.venv/bin/protoc-gen-purerpc
gen tests/relay/_generated --grpc_python_out=tests/relay/_generated
