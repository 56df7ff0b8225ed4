#!/usr/bin/env bash
# Runs a training command unchanged, shows its output as usual, and streams the metrics its log
# lines print (Megatron, DeepSpeed, Hugging Face Trainer, torchtitan, nanoGPT, llm.c or JSONL) to
# gradwatchd through `gradwatch tail -`. Exits with the trainer's own status: the monitor never
# changes what the job does, and a monitor that fails never fails the job.
#
#   deploy/examples/gradwatch-sidecar.sh --run my-job -- torchrun --nproc-per-node 8 pretrain_gpt.py ...
#
# Options (before --):
#   --run ID       the run's id (required)
#   --gradwatch P  the gradwatch binary (default: gradwatch on PATH)
#   --             then the training command and its arguments
# Everything else before -- is passed to `gradwatch tail` (--addr, --format, --step-interval, -v).
# The address can also come from GRADWATCH_ADDR.
set -u -o pipefail

gradwatch=gradwatch
run=""
tail_args=()
while (($#)); do
  case "$1" in
    --run) run="${2:?--run needs a value}"; shift 2 ;;
    --gradwatch) gradwatch="${2:?--gradwatch needs a value}"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) tail_args+=("$1"); shift ;;
  esac
done
if [[ -z "$run" || $# -eq 0 ]]; then
  echo "usage: $0 --run ID [gradwatch tail options] -- COMMAND [ARGS...]" >&2
  exit 2
fi

# The trainer's stdout and stderr go where this script's stdout goes (the terminal, the job's log)
# as before, through fd 3, and a copy goes to gradwatch tail. tee -p goes on writing to fd 3 if the
# tail ends early, so the job is never stopped by its monitor. --finish records the run as finished
# once the trainer's output ends; the pipeline waits for the tail's last acknowledgements.
exec 3>&1
"$@" 2>&1 | tee -p /dev/fd/3 | "$gradwatch" tail - --run "$run" --finish "${tail_args[@]}" >&2
status=${PIPESTATUS[0]}
exit "$status"
