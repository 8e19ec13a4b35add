#!/usr/bin/env bash
# The one entry point for experiments. See README.md.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: ./launch.sh COMMAND [CONFIG[:ARG]] [--workdir DIR] [--config.FIELD=VALUE ...] [options]
       ./launch.sh COMMAND --help     (that command's options; train CONFIG --help: CONFIG's fields)

commands:
  train     train CONFIG, resuming from DIR's latest checkpoint if there is one
  eval      metrics on the eval splits from DIR's latest checkpoint (--step N for another)
  generate  text in, text out from a checkpoint: --prompt "TEXT" (repeatable) or stdin lines;
            or from a Hugging Face folder: ./launch.sh generate --pretrained DIR --prompt "TEXT"
  average   average the last K checkpoints (--last_k 5) into a new workdir (--output DIR)
  compile   compile CONFIG's train step for a machine you need not have: --target NAME
            (compile --help lists them) [--json FILE]; per-chip memory, FLOPs, traffic,
            roofline MFU and collective bytes; exits 1 if it does not fit
  lm_eval   tasks of EleutherAI's lm-evaluation-harness on DIR's checkpoint: --tasks a,b
            [--limit N] [--num_fewshot K] [--include_path TASK_DIR]; results printed and in
            DIR/lm_eval/results.json (needs pip install -e ".[eval]"); with --num_processes
            process 0 runs the harness and shares each batch with the others
  data      ./launch.sh data multi30k: download Multi30k into data/multi30k/ (what
            configs/translate.py reads); offline it says where to put the files
  sweep     train every run of CONFIG's get_sweep(ARG), one workdir each (resumable):
            [--seeds 0,1,2] [--parallel N] [--dry_run] [--workdir ROOT] [--slurm [--submit]]
  report    ./launch.sh report ROOT [--metrics a,b] [--x FIELD]: table (mean ± std over
            seeds; .md, .csv, .json) and PNG plots of a sweep

CONFIG is a file in configs/; ARG picks a variant (configs/char_lm.py:runlocal).
Override any field: --config.model.position_scheme=rope --config.train.num_steps=500

Default workdir: workdirs/<config>[_<arg>] plus +<field>=<value> for each --config override,
in command-line order (the field's last name, its dotted path when two share one; a path
value as its file stem; characters other than A-Za-z0-9._- become _; a name over 100
characters is cut and ends in an 8-digit hash). Overrides that do not change what is trained
(generate.*, eval.*, train.progress_bar, log_every, tracker, compilation_cache_dir,
profile_*, async_checkpoints) are left out.
--workdir DIR to continue a run under other settings.
E.g. char_lm.py:runlocal --config.model.position_scheme=alibi trains in
workdirs/char_lm_runlocal+position_scheme=alibi.

eval, generate, average and lm_eval use the config the run saved (DIR/config.json): CONFIG may be
left out (./launch.sh generate --workdir DIR --prompt "TEXT"); --config.FIELD=VALUE still
overrides it. Relative paths (CONFIG, DIR, data paths in configs) are relative to the
repository root, wherever launch.sh is called from.

multi-process (local test of a multi-host run; on clusters see README "Scaling"):
  --num_processes N          start N local processes joined by jax.distributed
  --devices_per_process D    simulated CPU devices per process (default 1)

examples:
  ./launch.sh train configs/synthetic_seq2seq.py
  ./launch.sh generate configs/synthetic_seq2seq.py --prompt 31415
  ./launch.sh generate --workdir workdirs/char_lm_runlocal --prompt ROMEO
  ./launch.sh train configs/char_lm.py:runlocal --config.model.position_scheme=alibi
  ./launch.sh sweep configs/synthetic_lm.py:runlocal --seeds 0,1 --parallel 2
  ./launch.sh report workdirs/sweeps/synthetic_lm_runlocal
  ./launch.sh lm_eval --workdir workdirs/char_lm_runlocal --tasks lambada_openai --limit 100
EOF
}

if [[ $# -eq 1 && ( $1 == -h || $1 == --help || $1 == help ) ]]; then usage; exit 0; fi
if [[ $# -eq 0 ]]; then
  echo "launch.sh: expected a COMMAND and a CONFIG" >&2; usage >&2; exit 2
fi
if [[ $# -lt 2 ]]; then
  echo "launch.sh: expected a COMMAND and a CONFIG (or --workdir DIR for eval, generate, average, lm_eval); see ./launch.sh --help" >&2
  exit 2
fi
command=$1; config=$2; shift 2
if [[ $command == sweep || $command == report ]]; then  # many runs: no devices here
  cd "$(dirname "$0")"
  exec "${PYTHON:-python}" -m "tfm.sweeps.$command" "$config" "$@"  # --help: their own options
fi
if [[ $command == data ]]; then  # not an experiment: DATASET instead of CONFIG, no devices
  cd "$(dirname "$0")"
  exec "${PYTHON:-python}" -m tfm.data.download "$config" "$@"
fi
if [[ $command == generate && ( $config == --pretrained || $config == --pretrained=* ) ]]; then
  # A Hugging Face folder instead of CONFIG: ./launch.sh generate --pretrained DIR --prompt ...
  if [[ $config == --pretrained ]]; then
    if [[ $# -lt 1 ]]; then echo "launch.sh: --pretrained needs a folder" >&2; exit 2; fi
    folder=$1; shift
  else
    folder=${config#*=}
  fi
  # Absolute, since the python below runs from the repository root; a failed cd leaves
  # `absolute` empty, so the message names `folder`.
  if ! absolute=$(cd "$folder" 2>/dev/null && pwd); then
    echo "launch.sh: --pretrained folder '${folder}' not found" >&2; exit 2
  fi
  cd "$(dirname "$0")"
  exec "${PYTHON:-python}" -m tfm.main generate --pretrained="$absolute" "$@"
fi
case "$command" in
  train|eval|generate|average|compile|lm_eval) ;;
  *) echo "launch.sh: unknown command '$command'; choose one of: train, eval, generate, average, compile, lm_eval, data, sweep, report" >&2
     exit 2 ;;
esac
# Relative paths (CONFIG, --workdir, --output, data paths inside configs) are relative to the
# repository root, wherever launch.sh is called from.
cd "$(dirname "$0")"
# Compiling for a GPU without one: the CUDA plugin registers only when told not to check the
# (absent) driver, before jax starts.
if [[ "$command" == compile ]]; then export JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1; fi
# CONFIG is optional for the commands on a run (eval, generate, average: the run's saved
# config); an option in its place is the first of the options.
if [[ $config == -* ]]; then set -- "$config" "$@"; config=""; fi
help=false
for arg in "$@"; do [[ $arg == -h || $arg == --help ]] && help=true; done
config_file=${config%%:*}
if [[ -n $config && ! -f $config_file ]]; then
  echo "launch.sh: config file '$config_file' not found (expected e.g. configs/char_lm.py[:ARG])" >&2
  exit 2
fi
if [[ -z $config && $help == false && ( $command == train || $command == compile ) ]]; then
  echo "launch.sh: $command needs a CONFIG (e.g. configs/char_lm.py:runlocal); see ./launch.sh $command --help" >&2
  exit 2
fi

needs_value() {  # needs_value NUM_ARGS_LEFT OPTION
  if [[ $1 -lt 2 ]]; then echo "launch.sh: $2 needs a value; see ./launch.sh $command --help" >&2; exit 2; fi
}

num_processes=1; devices_per_process=1; args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --num_processes) needs_value $# "$1"; num_processes=$2; shift 2 ;;
    --num_processes=*) num_processes=${1#*=}; shift ;;
    --devices_per_process) needs_value $# "$1"; devices_per_process=$2; shift 2 ;;
    --devices_per_process=*) devices_per_process=${1#*=}; shift ;;
    --workdir|--prompt|--step|--last_k|--output|--eval_seq_len|--target|--json|--tasks|--limit|--num_fewshot|--include_path) needs_value $# "$1"; args+=("$1=$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
for n in "$num_processes" "$devices_per_process"; do
  if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
    echo "launch.sh: --num_processes and --devices_per_process take a whole number >= 1; got '$n'" >&2
    exit 2
  fi
done

python=${PYTHON:-python}
# Other XLA flags pass through; the device count is this script's to set.
inherited_xla_flags=$(sed 's/--xla_force_host_platform_device_count=[0-9]*//g' <<<"${XLA_FLAGS:-}")
if [[ $num_processes -eq 1 ]]; then
  export XLA_FLAGS="--xla_force_host_platform_device_count=$devices_per_process $inherited_xla_flags"
  exec "$python" -m tfm.main "$command" ${config:+--config="$config"} "${args[@]}"
fi

# N local processes as one multi-host run: process 0 is the coordinator.
port=$("$python" -c 'import socket; s=socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')
pids=()
for ((i = 0; i < num_processes; i++)); do
  TFM_COORDINATOR="localhost:$port" TFM_NUM_PROCESSES=$num_processes TFM_PROCESS_ID=$i \
    XLA_FLAGS="--xla_force_host_platform_device_count=$devices_per_process $inherited_xla_flags" \
    JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} \
    "$python" -m tfm.main "$command" ${config:+--config="$config"} "${args[@]}" &
  pids+=($!)
done
stopping=0
trap 'stopping=1; kill -TERM "${pids[@]}" 2>/dev/null' INT TERM
# A process that dies (SIGKILL, out of memory, a crash) leaves the others blocked in a
# collective until the coordination service gives up (~100 s) and aborts them with a C++ stack
# dump: say which one ended, stop the others at once (nothing they hold can be saved without
# it), and how to resume. Polled, not `wait -n`, which bash < 5.1 (macOS) lacks. Bash's own
# "line N: PID Killed  TFM_COORDINATOR=... python -m tfm.main ..." notices go to /dev/null (the
# processes keep the terminal), ours to fd 3.
exec 3>&2 2>/dev/null
status=0; running=("${!pids[@]}")
while [[ ${#running[@]} -gt 0 ]]; do
  still=()
  for i in "${running[@]}"; do
    if kill -0 "${pids[$i]}" 2>/dev/null; then still+=("$i"); continue; fi
    code=0; wait "${pids[$i]}" || code=$?
    if [[ $code -eq 0 || $status -ne 0 ]]; then continue; fi
    status=$code
    if [[ $stopping -eq 1 ]]; then continue; fi  # interrupted here: each process saves and ends
    how="exit status $code"
    if [[ $code -gt 128 ]]; then how="signal $(kill -l $((code - 128)))"; fi
    again="To retry, run the same command again:"
    if [[ $command == train ]]; then
      again="To resume from the last checkpoint, run the same command again:"
    fi
    others="the other $((num_processes - 1)) processes"
    if [[ $num_processes -eq 2 ]]; then others="the other process"; fi
    echo "launch.sh: process $i (pid ${pids[$i]}) ended with $how; stopped $others. $again$(
      printf ' %q' ./launch.sh "$command" ${config:+"$config"} "${args[@]}" \
      --num_processes "$num_processes" --devices_per_process "$devices_per_process")" >&3
    kill -KILL "${pids[@]}" 2>/dev/null || true
  done
  running=("${still[@]+"${still[@]}"}")
  if [[ ${#running[@]} -gt 0 ]]; then sleep 0.2; fi
done
exec 2>&3 3>&-
exit $status
