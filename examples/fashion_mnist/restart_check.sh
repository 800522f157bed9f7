#!/bin/sh
# The Fashion-MNIST example under ddp-launch --max-restarts 1: the last rank kills itself mid-way through epoch
# 2 (--crash-at-step), every rank restarts, resumes from epoch 1's checkpoint (--resume) and must end with the
# test accuracy of an uninterrupted run, within 0.5 %.
#   restart_check.sh <ddp-launch> <fashion_mnist> <scratch dir>
set -u
launch=$1 example=$2 dir=$3
plain_log=$dir/fm_restart_check.plain.log restart_log=$dir/fm_restart_check.restart.log
rm -rf "$dir/fm_restart_check.plain.safetensors" "$dir/fm_restart_check.restart.safetensors" "$dir/fm_restart_check.flight"
export DDP_FLIGHT_RECORDER_DIR=$dir/fm_restart_check.flight  # the killed attempt's records stay in the build tree
mkdir -p "$DDP_FLIGHT_RECORDER_DIR"
"$launch" -n 2 --timeout 120 "$example" --epochs 2 --no-progress \
  --checkpoint "$dir/fm_restart_check.plain.safetensors" >"$plain_log" 2>&1 || { cat "$plain_log"; exit 1; }
"$launch" -n 2 --timeout 120 --max-restarts 1 "$example" --epochs 2 --no-progress --resume --crash-at-step 700 \
  --checkpoint "$dir/fm_restart_check.restart.safetensors" >"$restart_log" 2>&1 || { cat "$restart_log"; exit 1; }
final() { sed -n 's/.*epoch 2\/2: .*test loss [^ ]* accuracy \([0-9.]*\) .*/\1/p' "$1" | tail -n 1; }
plain=$(final "$plain_log") restarted=$(final "$restart_log")
echo "uninterrupted: test accuracy $plain; killed at step 700 and restarted: $restarted"
for line in "kills itself at step 700" "restarting every rank (restart 1 of 1)" "resumed from .* after epoch 1"; do
  grep -q "$line" "$restart_log" || { cat "$restart_log"; echo "missing in the restarted run's output: $line"; exit 1; }
done
[ -n "$plain" ] && [ -n "$restarted" ] &&
  awk -v a="$plain" -v b="$restarted" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.005) }' ||
  { echo "the accuracies differ by more than 0.5 % (or one is missing)"; exit 1; }
