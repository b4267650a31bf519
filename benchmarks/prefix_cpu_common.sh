# Sourced by the CPU cache-affinity repeat scripts (prefix_wait_weight_cpu.sh,
# prefix_chat_repeats_cpu.sh): the stack and the two workloads of
# prefix_affinity_cpu.sh, without their search's starting rates and seeds.
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-benchmarks/results/tmp/cpu-small}
[ -f "$MODEL/config.json" ] || "$PY" -m benchmarks model-dir "$MODEL" --shape cpu-small >/dev/null
stack_args=(--start-stack --replicas 2 --model "$MODEL" --replica-arg=--load-format --replica-arg=dummy
            --replica-arg=--max-num-seqs --replica-arg=8 --replica-arg=--chunk-size --replica-arg=256
            --output-dist fixed --tbt-slo 0.25 --ttft-p99-slo 2 --warmup 4 --hardware none --no-progress
            --out-dir benchmarks/results/tmp/prefix_cpu)
shared_workload=(--replica-arg=--num-blocks --replica-arg=256 --workload shared-prefix --groups 8
                 --questions 64 --system-len 768 --prompt-dist uniform --prompt-min 16 --prompt-max 64
                 --output-len 16)
chat_workload=(--replica-arg=--num-blocks --replica-arg=1536 --workload multi-turn --conversations 256
               --turns 4 --system-len 256 --prompt-dist uniform --prompt-min 64 --prompt-max 192
               --output-len 32)
