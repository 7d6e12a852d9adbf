#!/bin/sh
# A stand-in trainer for scale tests (bench/operator_scale.py), mapped to the image
# `tpujob-stub-trainer` in devcluster/images.yaml: a POSIX sh loop of a few MB instead of a JAX
# process, so that a thousand of them fit on a small machine. It keeps the trainer contract the
# operator reads (contract/src/tpujob_contract): it resumes from $TPUJOB_RESUME_STEP, writes the
# progress record to $TPUJOB_RUN_DIR/progress.json with the job's uid and attempt, and commits
# steps as checkpoints/<step>/commit_success.txt (the commit marker alone: no array data), keeping
# the latest $TPUJOB_CHECKPOINT_KEEP_LATEST. It talks to the GCS emulator's JSON API with curl at
# $STORAGE_EMULATOR_HOST.
#
# Cadence (env, all optional):
#   STUB_PROGRESS_SECONDS   seconds between progress records (default 20)
#   STUB_COMMIT_SECONDS     seconds between committed steps (default 180)
#   STUB_STEPS_PER_SECOND   training speed (whole steps, default 1)
#   STUB_STEPS              the step it finishes at, exiting 0 (default 0: runs until killed)
# The first record is written at start; later ones and the commits start at a random offset within
# their interval, so many stubs started together do not write in lockstep.
# SIGTERM: exits 143 (the contract's "preempted"), as the real trainer does after its save.
set -u

now() { date -u +%Y-%m-%dT%H:%M:%S.%6NZ; }

started_at=$(now)
progress_s=${STUB_PROGRESS_SECONDS:-20}
commit_s=${STUB_COMMIT_SECONDS:-180}
rate=${STUB_STEPS_PER_SECOND:-1}
total=${STUB_STEPS:-0}
keep=${TPUJOB_CHECKPOINT_KEEP_LATEST:-3}
gcs=${STORAGE_EMULATOR_HOST:?STORAGE_EMULATOR_HOST is not set}
run=${TPUJOB_RUN_DIR:?TPUJOB_RUN_DIR is not set}
attempt=${TPUJOB_ATTEMPT:-0}
uid=${TPUJOB_UID:-}

rest=${run#gs://}
bucket=${rest%%/*}
prefix=${rest#"$bucket"}
prefix=${prefix#/}
prefix=${prefix%/}
[ -n "$prefix" ] && prefix="$prefix/"

case ${TPUJOB_RESUME_STEP:-fresh} in
  '' | *[!0-9]*) start_step=0 restored=null ;; # latest / fresh: the stub starts from step 0
  *) start_step=$TPUJOB_RESUME_STEP restored=$TPUJOB_RESUME_STEP ;;
esac
committed_list=""
last_committed=null
if [ "$restored" != null ]; then
  committed_list=$restored
  last_committed=$restored
fi

parent=$PPID # the pod runner: a stub whose runner is gone (killed with its devcluster) stops too
sleeper=""
trap '[ -n "$sleeper" ] && kill "$sleeper" 2>/dev/null; exit 143' TERM

put() { # put OBJECT DATA
  curl -sS -f -m 10 -o /dev/null -X POST -H 'Content-Type: application/json' --data-binary "$2" \
    "$gcs/upload/storage/v1/b/$bucket/o?uploadType=media&name=$1" || echo "stub: writing $1 failed" >&2
}

delete() { # delete OBJECT
  curl -sS -f -m 10 -o /dev/null -X DELETE "$gcs/storage/v1/b/$bucket/o/$(printf %s "$1" | sed 's|/|%2F|g')" ||
    echo "stub: deleting $1 failed" >&2
}

first_step_at=""
progress() { # progress STEP STATE
  at=$(now)
  [ -z "$first_step_at" ] && first_step_at=$at
  restore=""
  [ "$restored" != null ] && restore="\"restore_started_at\": \"$started_at\", \"restore_finished_at\": \"$started_at\","
  put "${prefix}progress.json" "{\"step\": $1, \"attempt\": $attempt, \"uid\": \"$uid\", \"state\": \"$2\",\
 \"updated_at\": \"$at\", \"steps_per_second\": $rate, \"last_committed_step\": $last_committed,\
 \"resumed_from_step\": $restored, \"restored_step\": $restored, \"process_started_at\": \"$started_at\",\
 \"storage_ready_at\": \"$started_at\", $restore \"first_step_at\": \"$first_step_at\"}"
}

commit() { # commit STEP: the marker, then the oldest beyond `keep` goes
  put "${prefix}checkpoints/$1/commit_success.txt" "committed"
  last_committed=$1
  committed_list="$committed_list $1"
  # shellcheck disable=SC2086
  set -- $committed_list
  while [ $# -gt "$keep" ]; do
    delete "${prefix}checkpoints/$1/commit_success.txt"
    shift
  done
  committed_list="$*"
}

jitter() { # a whole number of seconds in [1, N]
  awk -v seed="$$$1" -v n="$1" 'BEGIN { srand(seed); print 1 + int(rand() * n) }'
}

t0=$(date +%s)
progress "$start_step" running
next_progress=$((t0 + $(jitter "$progress_s")))
next_commit=$((t0 + $(jitter "$commit_s")))
while :; do
  kill -0 "$parent" 2>/dev/null || exit 0
  t=$(date +%s)
  step=$((start_step + (t - t0) * rate))
  if [ "$total" -gt 0 ] && [ "$step" -ge "$total" ]; then
    commit "$total"
    progress "$total" succeeded
    exit 0
  fi
  if [ "$t" -ge "$next_commit" ]; then
    commit "$step"
    next_commit=$((next_commit + commit_s))
  fi
  if [ "$t" -ge "$next_progress" ]; then
    progress "$step" running
    next_progress=$((next_progress + progress_s))
  fi
  wake=$next_progress
  [ "$next_commit" -lt "$wake" ] && wake=$next_commit
  pause=$((wake - $(date +%s)))
  [ "$pause" -lt 1 ] && pause=1
  sleep "$pause" &
  sleeper=$!
  wait "$sleeper"
  sleeper=""
done
