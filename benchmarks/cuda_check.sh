#!/usr/bin/env bash
# The CUDA checks of one GPU session, in one run (GPU time is lent in minutes):
#   1. tests/test_cuda.py: greedy equality with HF on the GPU, batches, prefix hits, bf16, sampling, n-gram
#   2. `tokenmill bench throughput --baseline hf` (HF generate in the same process) on workloads A and C
#      of benchmarks/peers.py, on random-weight models built from the config + tokenizer folders in $1
#      (tiny100m and llama1b: copy them from ~/.cache/tokenmill-peers/models without model.safetensors)
#   3. a torch.profiler table of llama1b decode steps (GPU kernels and host time)
#   4. `tokenmill serve --device cuda` on llama1b: a chat completion, then `tokenmill bench serve`
#      (all at once, and one at a time); the server's packages (fastapi, uvicorn, pydantic...) must be
#      importable there
#   tests and the GGUF ones need `gguf` there too (a pure-Python wheel; the rest of the path needs nothing
#   beyond torch, transformers, safetensors, numpy, psutil and tqdm)
# Usage, in the repository root of a machine with CUDA: benchmarks/cuda_check.sh [config-folders] [out-folder]
# (the whole output is also in out-folder/log.txt); STEPS="tests models bench profile serve" (the default)
# picks steps (bench, profile and serve need models).
set -u
CONFIGS=${1:-.gpu}
RESULTS=${2:-${OUT:-/tmp/cuda-check}}
mkdir -p "$RESULTS" /tmp/cuda-models
exec > >(tee "$RESULTS/log.txt") 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
STEPS=" ${STEPS:-tests models bench profile serve} "
want() { [[ $STEPS == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

want tests && echo "== tests/test_cuda.py" && timeout 240 python3 -m pytest tests/test_cuda.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tail -40

want models && echo "== random-weight models" && timeout 120 python3 - "$CONFIGS" /tmp/cuda-models <<'EOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for folder in sorted(p for p in src.iterdir() if (p / "config.json").exists()):
    out = dst / folder.name
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for f in folder.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    print(folder.name, f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
EOF

bench() {  # model workload args...
    local model=$1 workload=$2; shift 2
    echo "== $model $workload"
    timeout 150 python3 -m tokenmill.entrypoints.cli bench throughput --model /tmp/cuda-models/$model --device cuda \
        --dtype bfloat16 --max-model-len 2048 --baseline hf --hf-batch-size 32 --disable-tqdm \
        --json "$RESULTS/$model-$workload.json" "$@" 2>&1 | grep -v -i warn | tail -25
}
A=(--dataset random --num-prompts 32 --input-len 128 --output-len 128)
C=(--dataset prefix --num-prompts 64 --prefix-len 1024 --suffix-len 32 --output-len 32)
if want bench; then
    bench tiny100m A "${A[@]}"
    bench llama1b A "${A[@]}"
    bench llama1b C "${C[@]}"
fi

want profile && echo "== profile: llama1b, 32 requests, 128 in, 32 out" && timeout 120 python3 - <<'EOF' 2>&1 | grep -v -i warn | tee "$RESULTS/profile.txt"
import time, torch
from torch.profiler import ProfilerActivity, profile
from tokenmill import LLM, SamplingParams
llm = LLM(model="/tmp/cuda-models/llama1b", device="cuda", dtype="bfloat16", max_model_len=2048)
prompts = [[(i * 7 + j * 13) % 40000 + 100 for j in range(128)] for i in range(32)]
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate(prompt_token_ids=prompts[:2], sampling_params=params, use_tqdm=False)
torch.cuda.synchronize(); t = time.perf_counter()
llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
torch.cuda.synchronize(); print(f"32 x (128 in, 32 out): {time.perf_counter() - t:.3f} s")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
EOF

want serve || exit 0
echo "== serve on cuda: llama1b"
python3 -m tokenmill.entrypoints.cli serve --model /tmp/cuda-models/llama1b --device cuda --dtype bfloat16 --max-model-len 2048 \
    --port 8011 > "$RESULTS/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf http://127.0.0.1:8011/health > /dev/null && break; kill -0 $SERVER 2>/dev/null || break; sleep 1; done
curl -s http://127.0.0.1:8011/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}'; echo
for extra in "" "--max-concurrency 1 --num-prompts 8"; do
    timeout 150 python3 -m tokenmill.entrypoints.cli bench serve --base-url http://127.0.0.1:8011 --dataset random \
        --tokenizer /tmp/cuda-models/llama1b --num-prompts 64 --input-len 128 --output-len 128 $extra --disable-tqdm 2>&1 | grep -v -i warn | tail -22
done
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
tail -5 "$RESULTS/serve.log"
