# shellcheck shell=bash disable=SC2154,SC2034 # sourced by run.sh: its variables and e2e/cluster/lib.sh's are set
# Story 9, uninstall: `helm uninstall` leaves no webhook configuration or admission policy; a gpubudget.io
# annotation and an eviction of a fresh pod then go through.

say "helm uninstall: nothing of the chart is left that could refuse a request"
make_pod "$NS_B" last tier=batch # a pod that outlived every story (the drain story evicts the others)
kubectl wait --for=condition=Ready pod/last -n "$NS_B" --timeout="${STEP_TIMEOUT}s" >/dev/null || die "pod last did not become Ready"
"$HELM" uninstall "$RELEASE" -n "$NS" --wait --timeout 2m >/dev/null || die "helm uninstall failed"
LEFT=$(kubectl get validatingwebhookconfigurations,mutatingwebhookconfigurations,validatingadmissionpolicies,validatingadmissionpolicybindings -o name 2>/dev/null | grep -F "$RELEASE" || true)
[ -z "$LEFT" ] || die "left after helm uninstall: $LEFT"
wait_for "no pod of the release left in $NS" bash -c "[ -z \"\$(kubectl get pods -n $NS -o name)\" ]"
kubectl annotate pod last -n "$NS_B" gpubudget.io/state=Over --overwrite >/dev/null \
  || die "a gpubudget.io annotation was refused after helm uninstall"
printf '{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"last","namespace":"%s"}}' "$NS_B" > "$WORK/eviction.json"
kubectl create --raw "/api/v1/namespaces/$NS_B/pods/last/eviction" -f "$WORK/eviction.json" >/dev/null \
  || die "an eviction was refused after helm uninstall"
info "no webhook or admission policy of $RELEASE left; an eviction and a gpubudget.io annotation go through"
