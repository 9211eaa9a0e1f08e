#!/usr/bin/env bash
# The GPU paths the README promises, on one GPU, ending in one summary line:
#   1. MiniDDP over NCCL at W = 1, against torch's DDP;
#   2. MiniDDP over gloo with CUDA tensors at W = 2, both ranks on the same GPU;
#   3. miniddp.collectives' send/recv algorithms on CUDA tensors, against torch.distributed;
#   4. the step benchmark on cuda (MiniDDP and torch's DDP, 2 ranks).
# 1-3 are `pytest -m cuda tests/test_cuda.py` (their CPU twins run in the normal suite); 4 runs
# the benchmark itself, to report its numbers. Logs stay in the folder the summary names.
#
#   scripts/gpu_check.sh        exit status 0 when everything passed
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! GPU=$(python3 -c 'import torch, sys
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) sees no GPU")
print(torch.cuda.get_device_name(0))' 2>&1); then
    echo "gpu_check: no CUDA device: $GPU; run it on a machine with an NVIDIA GPU" >&2
    exit 1
fi

LOGS=$(mktemp -d -t gpu_check.XXXXXX)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python3 -m pytest -q -p no:cacheprovider -m cuda -k "not benchmark" tests/test_cuda.py \
    --junitxml="$LOGS/tests.xml" >"$LOGS/tests.log" 2>&1
python3 -m miniddp.bench step --device=cuda --models=mlp --variants=miniddp,torch --iters=20 \
    --trace-iters=2 --json="$LOGS/bench.json" >"$LOGS/bench.log" 2>&1

python3 - "$LOGS" "$GPU" <<'EOF'
import json, sys, xml.etree.ElementTree as ElementTree
from pathlib import Path

logs, gpu = Path(sys.argv[1]), sys.argv[2]
names = {
    "test_miniddp_on_one_rank_over_the_devices_backend_matches_torch_ddp": "MiniDDP NCCL W=1",
    "test_miniddp_on_two_ranks_over_gloo_matches_torch_ddp": "MiniDDP gloo+CUDA W=2",
    "test_send_recv_collectives_match_torch": "send/recv collectives on CUDA",
}
outcome = {name: "not run" for name in names.values()}
if (logs / "tests.xml").exists():
    for case in ElementTree.parse(logs / "tests.xml").iter("testcase"):
        name = names.get(case.get("name", "").split("[")[0])
        if name:
            failed = case.find("failure") is not None or case.find("error") is not None
            outcome[name] = "skipped" if case.find("skipped") is not None else (
                "FAILED" if failed else "ok")
try:
    row = json.loads((logs / "bench.json").read_text())["results"][0]["rows"]
    bench = (f"ok (mlp step: miniddp {row['miniddp']['median_ms']:.2f} ms, torch "
             f"{row['torch']['median_ms']:.2f} ms, paired {row['miniddp']['vs_reference']:.2f}x)")
except (OSError, KeyError, IndexError, ValueError):
    bench = "FAILED"
outcome["step bench on cuda"] = bench
passed = all(value.startswith("ok") for value in outcome.values())
for log in ("tests.log", "bench.log"):
    if not passed and (logs / log).exists():
        print(f"--- {log} (last lines)\n" + "\n".join((logs / log).read_text().splitlines()[-25:]),
              file=sys.stderr)
details = "; ".join(f"{name} {value}" for name, value in outcome.items())
print(f"gpu_check: {'PASS' if passed else 'FAIL'} on {gpu}: {details}; logs {logs}")
sys.exit(0 if passed else 1)
EOF
