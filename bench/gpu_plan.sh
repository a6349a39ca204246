#!/usr/bin/env bash
# What a lent GPU runs first, in one device call, in order of what is still unmeasured, within a
# deadline: the device tool lends about 15 minutes a session (the machine's start included) and
# at most 10 minutes a command, so a session gets one such call and perhaps a second.
#
#   here:   .venv/bin/python bench/device_site.py        # .device_site.tar.xz (~25 MiB)
#   device: bash bench/gpu_plan.sh "$OUT" [SECONDS] [PARTS]   (carry: .device_site.tar.xz)
#
# SECONDS (default 540) bounds the whole call; each part gets the time left and is stopped when
# it runs out. PARTS (default "memory 04 03 01 02"), in order:
#   memory  bench/gpu_session.py --memory-only: what the GPU holds outside PyTorch's allocator,
#           the fake-tensor prediction against max_memory_allocated (1.2 B model, five stacks,
#           on the current training loop; three again with expandable segments and three with
#           max_split_size_mb:128, the allocator's replay beside max_memory_reserved) and
#           Unsloth's Llama-3.1-8B QLoRA rows measured on the GPU itself, the published table's
#           open misses, then that row on a 24 GB share of the GPU under each allocator
#           setting, fit or out of memory beside the replay's verdict
#           -> $OUT/raw/gpu_session_memory.json. All of it takes longer than one call: the five
#           stacks alone took 160 s on the H100 (results/h100/raw), the 8 B parts are untimed.
#           GPU_SESSION_PARTS=name,... runs those of bench/gpu_session.py's parts only (in its
#           order: outside_allocator, fake_vs_real, fake_vs_real_expandable,
#           fake_vs_real_max_split, fake_vs_real_rounding, fake_vs_real_expandable_max_split,
#           unsloth_8b, card_share, card_share_max_split), e.g.
#           GPU_SESSION_PARTS=outside_allocator,fake_vs_real_expandable,card_share for a call
#           that checks the replay's settings where no GPU has yet.
#   04 ...  a notebook at SCALE="gpu" (the speed claims at the sizes where they should pay)
#           -> $OUT/<notebook>.ipynb executed, and its figures in $OUT/results/
# A part that fails or runs out of time does not stop the next; what a part wrote stays: a
# notebook stopped before its end leaves the figures it reached as its results file, marked
# partial (recipes_lib.results.keep_partial), and the executed copy up to its last cell.
# Then, here (DEVICE: h100, h200, ... as the reply's device says):
#   mkdir -p results/DEVICE/raw && cp FILES_AT/raw/*.json results/DEVICE/raw/
#   .venv/bin/python bench/gpu_session.py --record DEVICE
#   cp FILES_AT/results/0*.json results/DEVICE/ && .venv/bin/python -m recipes_lib readme
# (a new DEVICE needs its <!-- results-table:DEVICE:begin/end --> markers in the README).
set -uo pipefail
out=${1:?usage: bench/gpu_plan.sh OUT_DIR [SECONDS] [PARTS]}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # before the cd below
deadline=$(( $(date +%s) + ${2:-540} ))
parts=${3:-memory 04 03 01 02}
cd "$(dirname "$0")/.."
left() { echo $(( deadline - $(date +%s) )); }

site=${DEVICE_SITE:-.device_site.tar.xz}
if [ ! -f "$site" ]; then
    echo "no $site: build it here (bench/device_site.py) and name it in carry" >&2
    exit 2
fi
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp/site')" "$site"
export PYTHONPATH=/tmp/site:$PWD MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1
mkdir -p "$out/raw" "$out/results"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

for part in $parts; do
    if [ "$(left)" -lt 60 ]; then
        echo "== $part: skipped, $(left) s left"
        continue
    fi
    start=$(date +%s)
    if [ "$part" = memory ]; then
        timeout "$(left)" python3 bench/gpu_session.py "$out/session" --memory-only
        rc=$?
        cp "$out/session/gpu_session.json" "$out/raw/gpu_session_memory.json" 2>/dev/null
    else
        nb=$(ls notebooks/"$part"_*.ipynb 2>/dev/null | head -1)
        if [ -z "$nb" ]; then
            echo "== $part: no notebook notebooks/${part}_*.ipynb" >&2
            continue
        fi
        rm -f "notebooks/executed/$(basename "$nb")"  # an earlier call's copy is not this one's
        RECIPES_RESULTS_DIR="$out/results" timeout "$(left)" \
            python3 -m recipes_lib run "$nb" -p SCALE gpu
        rc=$?
        cp "notebooks/executed/$(basename "$nb")" "$out/" 2>/dev/null
        if [ "$rc" -ne 0 ]; then
            sleep 2  # a killed runner's kernel exits within a second (ipykernel's parent poller)
            python3 -c "import sys; from recipes_lib import results
kept = results.keep_partial(sys.argv[1], sys.argv[2])
print(f'the figures it reached: {kept}' if kept else 'no figures kept apart: its results '
      'file was saved (the failure came after its last cell), or it recorded none')" \
                "$(basename "$nb" .ipynb)" "$out/results"
        fi
    fi
    echo "== $part: exit $rc (124: out of time), $(( $(date +%s) - start )) s, $(left) s left"
done
