#!/bin/bash
# The GPU checks of issue 40 in one command, for a lent GPU machine that reaches no registry.
#
#   bash benchmarks/gpu_checks/run.sh prepare     # here (CPU, online): wheels, tokenizer, chats into .gpu/
#   bash benchmarks/gpu_checks/run.sh             # there, with .gpu carried: every stage, results in $OUT
#   REHEARSE=1 bash benchmarks/gpu_checks/run.sh  # here: the same stages on CPU at tiny sizes
#
# Stages, timings first (alone on the device), then correctness together:
#   1. bench_gpu.py at 1.1B, fsdp_lab beside the ceiling loop
#   2. experiment=gpu_1b profile=trace: the step split and compute by kernel kind
#   3. a MoE preset scaled to 892M parameters: experts_implementation grouped_mm vs eager
#   4. in parallel: profile=memory on gpu_160m beside fsdp-lab plan; data=chat packed vs padded
#      with SmolLM2-135M's config and tokenizer (random weights) plus per-token losses of packed
#      rows on CUDA; two ranks sharing the GPU (hardware.backend=gloo) against the unsharded
#      reference.
# DEADLINE (seconds, default 480) bounds the whole: each stage gets its share or what is left.
# $OUT/summary.txt has the figures; logs.tgz, trace.tgz, memory.tgz the files behind them.
set -u
cd "$(dirname "$0")/../.."
G=.gpu

if [ "${1:-}" = prepare ]; then
  mkdir -p $G/whl $G/smollm2
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d $G/whl \
    hydra-core==1.3.8 omegaconf==2.3.1 "transformers==$(python -c 'import transformers; print(transformers.__version__)')"
  python -m pip wheel -q --no-deps -w $G/whl antlr4-python3-runtime==4.9.3  # an sdist on PyPI
  MODEL=$(python scripts/prepare_smollm2.py | tail -1)
  cp "$MODEL"/{config.json,chat_template.jinja,generation_config.json,tokenizer.json,tokenizer_config.json} $G/smollm2/
  python scripts/shakespeare_chats.py $G/chats.jsonl
  grep -qx "/$G/" .git/info/exclude 2>/dev/null || echo "/$G/" >> .git/info/exclude
  du -sh $G
  exit 0
fi

OUT=${OUT:-/tmp/gpu_checks_out}; mkdir -p "$OUT"
W=/tmp/gpu_checks; rm -rf $W; mkdir -p $W/logs
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor WANDB_MODE=disabled
if [ -z "${REHEARSE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $G/whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
  HW="hardware=gpu"; BIG=1; PY=python3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/summary.txt
else
  export PYTHONPATH=$PWD
  HW="hardware=cpu"; BIG=0; PY=python
  echo "rehearsal on CPU" > $OUT/summary.txt
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> $OUT/summary.txt 2>&1
S() { echo "== $(date +%T) $*" | tee -a $OUT/summary.txt; }
COMMON="logger=none checkpoint=none trainer.progress_bar=false trainer.eval_every=0"
DEADLINE=${DEADLINE:-480}
T0=$SECONDS
TO() { local l=$((DEADLINE - (SECONDS - T0) - 25)); [ $l -lt 5 ] && l=5; [ "$1" -lt $l ] && echo "$1" || echo $l; }
RUN() { local t=$1; shift; timeout -k 5 "$(TO "$t")" "$@"; }

S "1 bench_gpu 1.1B"
if [ $BIG = 1 ]; then
  RUN 200 $PY benchmarks/bench_gpu.py --models 1b --sides fsdp_lab,ceiling --json $OUT/bench-1b.json > $W/logs/bench.log 2>&1
  tail -5 $W/logs/bench.log >> $OUT/summary.txt
fi

S "2 profile=trace"
if [ $BIG = 1 ]; then M="experiment=gpu_1b"; else M="$HW precision=fp32"; fi
RUN 150 $PY train.py hydra.run.dir=$W/trace $M profile=trace trainer.max_steps=8 $COMMON > $W/logs/trace.log 2>&1
echo "rc=$?" >> $OUT/summary.txt
$PY -m fsdp_lab.tools.cli profile $W/trace > $W/logs/profile.txt 2>&1; cat $W/logs/profile.txt >> $OUT/summary.txt
(cd $W && tar czf $OUT/trace.tgz trace/run.json trace/profile trace/metrics.jsonl 2>/dev/null)

if [ $BIG = 1 ]; then
  MOE="model.hidden_size=1024 model.num_layers=8 model.num_heads=16 model.num_kv_heads=4 model.num_experts=64 model.experts_per_token=8 model.expert_intermediate_size=512 model.vocab_size=32000 model.max_position_embeddings=2048 trainer.seq_len=2048 trainer.micro_batch_size=8 trainer.max_steps=20 precision=bf16"
else
  MOE="trainer.max_steps=6 precision=fp32"
fi
for impl in grouped_mm eager; do
  S "3 MoE experts_implementation=$impl"
  RUN 100 $PY train.py hydra.run.dir=$W/moe_$impl $HW model=qwen3_moe_tiny $MOE trainer.log_every=5 model.experts_implementation=$impl $COMMON > $W/logs/moe_$impl.log 2>&1
  echo "rc=$?" >> $OUT/summary.txt
  $PY - $W/moe_$impl/metrics.jsonl >> $OUT/summary.txt 2>&1 <<'EOF'
import json, statistics, sys
r = [json.loads(line) for line in open(sys.argv[1])]
r = [x for x in r if x.get("split") == "train"]
late = [x for x in r if x["step"] > 5] or r
print("median tokens/s", round(statistics.median(x["tokens_per_s"] for x in late)),
      "peak GiB", round(max(x["peak_mem_bytes"] for x in r) / 2**30, 2),
      "losses", [round(x["loss"], 4) for x in r[:3]], "...", round(r[-1]["loss"], 4))
EOF
done

S "4 memory | chat | two ranks, in parallel"
(
  if [ $BIG = 1 ]; then M="experiment=gpu_160m"; MODE=memory; else M="$HW precision=fp32"; MODE=trace; fi
  RUN 150 $PY train.py hydra.run.dir=$W/memory $M profile=$MODE trainer.max_steps=8 $COMMON > $W/logs/memory.log 2>&1
  echo "memory rc=$?" >> $W/logs/memory.log
  $PY -m fsdp_lab.tools.cli plan $M --json > $W/logs/plan.json 2>> $W/logs/memory.log
  $PY - $W/memory $W/logs/plan.json >> $W/logs/memory.log 2>&1 <<'EOF'
import glob, json, pickle, sys
run, plan = sys.argv[1], json.load(open(sys.argv[2]))
for path in glob.glob(run + "/profile/rank0.memory.pickle"):
    from torch.cuda import _memory_viz
    snapshot = pickle.load(open(path, "rb"))
    html = _memory_viz.trace_plot(snapshot)  # what torch's viewer draws
    print("snapshot events", sum(len(t) for t in snapshot["device_traces"]), "html bytes", len(html))
steps = [json.loads(line) for line in open(run + "/metrics.jsonl")]
peak = max(x["peak_mem_bytes"] for x in steps if x.get("split") == "train")
planned = plan["strategies"][plan["chosen"]]["peak"]
print(f"run peak {peak / 2**30:.2f} GiB, plan {planned / 2**30:.2f} GiB, ratio {peak / planned:.2f}")
EOF
) &
(
  if [ $BIG = 1 ]; then C="precision=bf16 trainer.seq_len=1024 trainer.micro_batch_size=8"; else C="precision=fp32 trainer.seq_len=256 trainer.micro_batch_size=2 trainer.max_steps=2 trainer.eval_every=2 trainer.eval_batches=2"; fi
  for packing in documents pad; do
    RUN 110 $PY train.py hydra.run.dir=$W/chat_$packing $HW model=local model.name_or_path=$PWD/$G/smollm2 model.pretrained=false data=chat data.files=$PWD/$G/chats.jsonl data.cache_dir=$W/chat_cache_$packing data.packing=$packing trainer.max_steps=10 $C logger=none checkpoint=none trainer.progress_bar=false trainer.eval_every=10 trainer.eval_batches=100000 > $W/logs/chat_$packing.log 2>&1
    echo "chat $packing rc=$?" >> $W/logs/chat.txt
    grep '"val"' $W/chat_$packing/metrics.jsonl | cut -c1-120 >> $W/logs/chat.txt
  done
  $PY benchmarks/gpu_checks/packing_per_token.py $([ $BIG = 1 ] && echo cuda || echo cpu) > $W/logs/packing.txt 2>&1
) &
(
  T="$HW precision=fp32 precision.tf32=false trainer.max_steps=8 $COMMON"
  RUN 60 $PY train.py hydra.run.dir=$W/one_rank $T hardware.nproc_per_node=1 > $W/logs/one_rank.log 2>&1
  RUN 90 $PY train.py hydra.run.dir=$W/two_ranks $T hardware.nproc_per_node=2 hardware.backend=gloo > $W/logs/two_ranks.log 2>&1
  echo "two ranks rc=$?" >> $W/logs/two.txt
  $PY benchmarks/gpu_checks/compare_reference.py $W/one_rank $W/two_ranks >> $W/logs/two.txt 2>&1
) &
wait
for f in memory.log chat.txt packing.txt two.txt; do echo "--- $f"; tail -c 2500 $W/logs/$f; done >> $OUT/summary.txt 2>&1
S "done in $((SECONDS - T0)) s"
(cd $W && tar czf $OUT/logs.tgz logs */run.json */metrics.jsonl 2>/dev/null)
(cd $W && tar czf $OUT/memory.tgz memory/profile 2>/dev/null)
for f in "$OUT"/*; do  # the device tool brings back files of 16 MiB at most
  if [ "$(stat -c %s "$f")" -gt 15500000 ]; then split -b 15000000 "$f" "$f.part-" && rm "$f"; fi
done
