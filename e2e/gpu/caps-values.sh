#!/usr/bin/env bash
# What the caps webhook writes holds on the driver (issue 32), on a real GPU under an MPS control daemon. Run as
# root on a host with an NVIDIA GPU, python3 + torch and nvidia-cuda-mps-control:
#
#   cargo run -q -p gpubudget-operator --example caps_values -- 3Gi > carry/caps-values.tsv
#   OUT=/tmp/out VALUES=carry/caps-values.tsv bash e2e/gpu/caps-values.sh
#
# For each value a tenant might write into a one-GPU container (operator/examples/caps_values.rs: every spelling
# measured, honoured or ignored, and more), one MPS client with the value as written (`raw`: a pod created while
# the webhook was down) and one with what the webhook writes under a 3 GiB budget (`written`), each asking for
# 6 GiB in 1 GiB tensors. The check: a written value never lets the client hold more than the budget (tensors +
# the CUDA context), and gpubudget's verdict on the raw value is true: "capped N MiB" only where the client met
# CUDA OOM within N MiB, "uncapped" where it did not (6 GiB held). Results in $OUT/caps-values.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d /tmp/gpubudget-caps-values-out.XXXX)}
VALUES=${VALUES:-carry/caps-values.tsv}
WORK=$(mktemp -d /tmp/gpubudget-caps-values.XXXX)
mkdir -p "$OUT"
# shellcheck source=e2e/lib.sh
source e2e/lib.sh
export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps-pipe CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
trap 'echo quit | nvidia-cuda-mps-control > /dev/null 2>&1 || true' EXIT
[ -f "$VALUES" ] || die "no $VALUES"
nvidia-cuda-mps-control -d
sleep 1
cat > "$WORK/client.py" <<'EOF'
import sys, torch
held = []
try:
    for _ in range(6):
        held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
except torch.cuda.OutOfMemoryError:
    pass
except Exception as e:  # any other CUDA failure: say what, count what was held
    print(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
print(len(held))
EOF
# held VALUE: GiB of tensors one MPS client got (0–6) with CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=VALUE; "?" when the
# client printed no count (its stderr goes to $OUT/clients.err).
held() {
  local n
  n=$(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=$1 timeout 120 python3 "$WORK/client.py" 2>>"$OUT/clients.err" | tail -n1) || true
  [[ $n =~ ^[0-6]$ ]] && echo "$n" || echo "?"
}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  echo "torch: $(python3 -c 'import torch; print(torch.__version__)')"
  echo "MPS control daemon: running; budget 3Gi (the webhook writes 0=3072M at most); each client asks 6 x 1 GiB"
  echo
  echo "| value | as written: GiB held | gpubudget says of it | webhook writes | then: GiB held | verdict true? |"
  echo "|---|---|---|---|---|---|"
} > "$OUT/caps-values.txt"
BAD=0
while IFS=$'\t' read -r name raw raw_verdict written _written_verdict; do
  echo "--- $name: raw" >> "$OUT/clients.err"; r=$(held "$raw")
  echo "--- $name: written" >> "$OUT/clients.err"; w=$(held "$written")
  ok=yes
  # The webhook's value: the budget (3 GiB, context included) at most, so 2 GiB of tensors.
  if [ "$w" = "?" ] || [ "$w" -gt 3 ]; then ok="NO: the written value let $w GiB through"; BAD=1; fi
  case $raw_verdict in
    capped*) mib=${raw_verdict#capped }; mib=${mib%% *}
             # Capped at MiB: never more than that held; under 6 GiB, the client must have met CUDA OOM.
             if [ "$r" = "?" ] || [ $(( r * 1024 )) -gt "$mib" ] || { [ "$mib" -lt 6144 ] && [ "$r" = 6 ]; }; then
               ok="NO: said capped $mib MiB, held $r GiB"; BAD=1
             fi ;;
    uncapped*) [ "$r" = 6 ] || ok="said uncapped, held $r GiB (the safe side: reported uncapped)" ;;
  esac
  # shellcheck disable=SC2016 # the backticks are Markdown's
  printf '| %s `%s` | %s | %s | `%s` | %s | %s |\n' "$name" "$raw" "$r" "${raw_verdict:0:60}" "$written" "$w" "$ok" >> "$OUT/caps-values.txt"
done < "$VALUES"
echo >> "$OUT/caps-values.txt"
[ "$BAD" = 0 ] && echo "every written value held the client within the budget; every 'capped' verdict was true" >> "$OUT/caps-values.txt" \
  || echo "FAIL: see the rows marked NO" >> "$OUT/caps-values.txt"
cat "$OUT/caps-values.txt"
exit "$BAD"
