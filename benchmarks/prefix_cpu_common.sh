# Sourced by the CPU cache-affinity scripts (prefix_affinity_cpu.sh and the repeat
# scripts beside it): the stack and the two workloads, without a search's starting
# rate or seed, defined here only.
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-benchmarks/results/tmp/cpu-small}
[ -f "$MODEL/config.json" ] || "$PY" -m benchmarks model-dir "$MODEL" --shape cpu-small >/dev/null
stack_args=(--start-stack --replicas 2 --model "$MODEL" --replica-arg=--load-format --replica-arg=dummy
            --replica-arg=--max-num-seqs --replica-arg=8 --replica-arg=--chunk-size --replica-arg=256
            --output-dist fixed --tbt-slo 0.25 --ttft-p99-slo 2 --warmup 4 --hardware none --no-progress
            --out-dir benchmarks/results/tmp/prefix_cpu)
# STACK_EXTRA: more harness arguments, e.g. the replicas' torch threads on a bigger host
# ("--replica-arg=--threads --replica-arg=2").
read -r -a stack_extra <<<"${STACK_EXTRA:-}"
stack_args+=("${stack_extra[@]}")
# Probe sizes are set so a probe lasts seconds at the capacities of the current
# engine (near 100 req/s here; 128 requests a probe last about 1.3 s).
# 8 groups x 768-token system prompt (384 blocks), 64 questions each: 512 requests.
shared_workload=(--replica-arg=--num-blocks --replica-arg=256 --workload shared-prefix --groups 8
                 --questions 64 --system-len 768 --prompt-dist uniform --prompt-min 16 --prompt-max 64
                 --output-len 16)
# 256 conversations x 4 turns after a 256-token system prompt; rates are
# conversations/s (enough conversations that their start rate, not their number,
# sets the load). At 20 conversations/s about 40 are under way, their histories (up
# to ~900 tokens) about 25k tokens: with 256 blocks (as shared has) a replica would
# hold little beyond its 8 running sequences.
chat_workload=(--replica-arg=--num-blocks --replica-arg=1536 --workload multi-turn --conversations 256
               --turns 4 --system-len 256 --prompt-dist uniform --prompt-min 64 --prompt-max 192
               --output-len 32)
