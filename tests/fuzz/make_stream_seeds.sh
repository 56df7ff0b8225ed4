#!/usr/bin/env bash
# Writes the seed corpus of fuzz_stream (tests/fuzz/corpus/stream/) from the text-format messages
# below: each seed is frames of a control byte (see stream_fuzzer.cc) and a TrainerMessage in
# protobuf's delimited format. Needs protoc; rerun after changing the messages or the schema.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
proto_dir=../../proto
out=corpus/stream
mkdir -p "$out"

# frame CONTROL TEXT: prints one frame as hex.
frame() {
  local control="$1" text="$2"
  printf '%s' "$text" | protoc --proto_path="$proto_dir" --encode=gradwatch.v1.TrainerMessage \
    gradwatch/v1/gradwatch.proto | /usr/bin/python3 -c '
import sys
body = sys.stdin.buffer.read()
n, varint = len(body), bytearray()
while True:
    byte, n = n & 0x7F, n >> 7
    varint.append(byte | (0x80 if n else 0))
    if not n:
        break
sys.stdout.write((bytes([int(sys.argv[1])]) + bytes(varint) + body).hex())
' "$control"
}

# seed NAME FRAME_HEX...: writes the frames as one binary file.
seed() {
  local name="$1"
  shift
  printf '%s' "$@" | /usr/bin/python3 -c 'import sys; sys.stdout.buffer.write(bytes.fromhex(sys.stdin.read()))' \
    > "$out/$name"
}

hello() {
  printf 'seq: 1 hello { run_id: "r" rank: %s world_size: 2 labels { key: "job" value: "pt" }
    config { hidden_size: 6144 z_loss_coef: 1e-4 weight_decay: 0.1 }
    params { name: "final_norm.weight" kind: PARAM_KIND_NORM_GAIN numel: 6144 init_norm: 78.4 }
    params { name: "lm_head.weight" kind: PARAM_KIND_OUTPUT numel: 788000000 } %s }' "$1" "${2:-}"
}
step() {
  printf 'seq: %s step { step: %s wall_time: 1.7e9 loss: 2.5 z_loss: 0.01 learning_rate: 3e-4 tokens: 4096
    total_grad { sq_sum: %s } params { index: 0 grad { norm: 0.01 } param { norm: 340 } update { sq_sum: 1e-6 } }
    params { index: 1 grad { sq_sum: 0.2 } } extra { key: "moe/aux_loss" value: 0.02 } }' "$1" "$2" "$3"
}

seed two_ranks \
  "$(frame 0 "$(hello 0)")" "$(frame 1 "$(hello 1)")" \
  "$(frame 0 "$(step 2 1 0.25)")" "$(frame 1 "$(step 2 1 0.25)")" \
  "$(frame 0 "$(step 3 2 0.3)")" "$(frame 1 "$(step 3 2 nan)")" \
  "$(frame 0 'seq: 4 event { step: 2 text: "switched to dropless EP routing" }')" \
  "$(frame 0 'seq: 5 goodbye { reason: GOODBYE_REASON_FINISHED message: "done" }')"
seed rewind_and_timeout \
  "$(frame 0 "$(hello 0)")" "$(frame 0 "$(step 2 1 0.25)")" "$(frame 0 "$(step 3 2 0.25)")" \
  "$(frame 193 "$(hello 0 'resume_from_step: 2')")" "$(frame 0 "$(step 4 2 inf)")" \
  "$(frame 191 "$(step 5 3 0.5)")"
seed errors \
  "$(frame 0 "$(step 1 1 0.25)")" "$(frame 0 'seq: 2')" \
  "$(frame 0 'seq: 3 hello { run_id: "bad id!" world_size: 1 }')" \
  "$(frame 0 "$(hello 0)")" "$(frame 0 'seq: 4 step { step: 1 total_grad { norm: -1 } }')" \
  "$(frame 0 'seq: 5 step { step: 1 params { index: 99 grad { norm: 1 } } }')" \
  "$(frame 2 "$(hello 0)")" "$(frame 0 'seq: 6 event { step: 1 text: "" }')" \
  "$(frame 0 'seq: 7 goodbye { reason: 99 }')"
# Extreme values: the largest step kept (2^63 - 1) and the first ones refused (2^63, 2^64 - 1), a
# world at the limit (2^20) and one past it, a catalog change mid-run and one refused.
seed extremes \
  "$(frame 0 "$(hello 0)")" "$(frame 1 "$(hello 1)")" \
  "$(frame 0 "$(step 2 9223372036854775806 0.25)")" "$(frame 1 "$(step 2 9223372036854775806 0.25)")" \
  "$(frame 0 "$(step 3 9223372036854775807 0.25)")" "$(frame 0 "$(step 4 9223372036854775808 0.25)")" \
  "$(frame 1 "$(step 3 18446744073709551615 0.25)")" \
  "$(frame 0 'seq: 5 catalog_update { from_step: 9223372036854775807 params { name: "final_norm.weight" weight_decay: 0.1 } }')" \
  "$(frame 0 'seq: 6 catalog_update { from_step: 18446744073709551615 params { name: "final_norm.weight" weight_decay: 0.1 } }')" \
  "$(frame 0 'seq: 7 catalog_update { from_step: 3 params { name: "nope" weight_decay: -1 } }')" \
  "$(frame 0 'seq: 8 event { step: 18446744073709551615 text: "past the end" }')" \
  "$(frame 2 'seq: 1 hello { run_id: "w" rank: 1048575 world_size: 1048576 }')" \
  "$(frame 3 'seq: 1 hello { run_id: "w2" rank: 0 world_size: 1048577 }')" \
  "$(frame 2 'seq: 2 step { step: 1 total_grad { norm: -inf } }')"
