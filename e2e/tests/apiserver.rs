//! The real API server tier: the release binaries against a real kube-apiserver (with etcd and
//! kube-controller-manager, no kubelet), with the chart's RBAC, admission policies and eviction webhook, driven
//! and checked over a `kube::Client` ([`harness`]). Each story runs only when asked with
//! `GPUBUDGET_E2E_APISERVER=1`, against the control plane of `KUBECONFIG` (its admin). A plain `cargo test`
//! lists them as ignored, with how to run them (`-- --ignored` and the switch); asked to run without the switch
//! (`--include-ignored`), they fail saying so rather than pass without running. See e2e/apiserver/README.md.

#[path = "apiserver/bound.rs"]
mod bound;
#[path = "apiserver/caps.rs"]
mod caps;
#[path = "apiserver/harness.rs"]
mod harness;
#[path = "apiserver/hostile_caps.rs"]
mod hostile_caps;
#[path = "apiserver/kubectl_plugin.rs"]
mod kubectl_plugin;
#[path = "apiserver/lifecycle.rs"]
mod lifecycle;
#[path = "apiserver/mirrors.rs"]
mod mirrors;
#[path = "apiserver/observe.rs"]
mod observe;
#[path = "apiserver/pressure.rs"]
mod pressure;
#[path = "apiserver/quota.rs"]
mod quota;
#[path = "apiserver/rbac.rs"]
mod rbac;
#[path = "apiserver/records_doors.rs"]
mod records_doors;
#[path = "apiserver/scale.rs"]
mod scale;
#[path = "apiserver/shares.rs"]
mod shares;
#[path = "apiserver/shares_tenant.rs"]
mod shares_tenant;
#[path = "apiserver/stories.rs"]
mod stories;
#[path = "apiserver/tenant.rs"]
mod tenant;

/// The ignore reason: how to run a story.
macro_rules! how {
    () => {
        "opt-in, needs a real kube-apiserver: GPUBUDGET_E2E_APISERVER=1 KUBECONFIG=/tmp/realk8s/run/kubeconfig \
         cargo test -p gpubudget-e2e --test apiserver -- --ignored --nocapture (e2e/apiserver/README.md)"
    };
}

/// Records, usage objects, events, eviction with the budget's grace, the agent restarted mid-grace, Warn,
/// overlaps, node restriction both ways, mirrors, the operator down and back, a PodDisruptionBudget escalated,
/// pressure, a GPU lost and back, two operator replicas with the leader crashed (formerly run.sh; ~130 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn stories_and_node_restriction_on_a_real_api_server() {
    stories::core().await;
}

/// Observe first (issue 54, formerly observe.sh): the agent as `agent.enforcement=Observe` starts it tells and
/// does not evict; `enforcement: observe` refused; a budget, then the Node, switched to Enforce act (~90 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn observe_first_on_a_real_api_server() {
    observe::observe_first().await;
}

/// Pressure relief where a neighbour is harmed (issue 52, formerly pressure-harm.sh): a lone pod at 77 GiB never
/// evicted, a Warn grower beside a neighbour within its request is, a pod behind a PDB beside a flapping neighbour
/// is deleted once 20 s of pressure have passed in all (~150 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn pressure_harm_on_a_real_api_server() {
    pressure::harm().await;
}

/// The pressure bound (issue 43, formerly pressure-bound.sh): under pressure a PodDisruptionBudget holds relief back
/// the node's --pressure-blocked-timeout (20 s here) at most, whatever the budget says (~150 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn pressure_bound_on_a_real_api_server() {
    bound::pressure_bound().await;
}

/// Budget mirrors off, and the operator gone (issue 43, formerly mirrors-off.sh): the Lease deleted, every mirror
/// deleted, budgets created and tightened, the operator SIGKILLed mid-edit: the agent enforces each budget's current
/// spec (~100 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn mirrors_off_on_a_real_api_server() {
    mirrors::mirrors_off().await;
}

/// Namespace totals enforced (issue 23, formerly quota.sh): six small pods on two nodes (two release agents), two
/// operator replicas, the leader killed mid-period: one eviction, the latest start (~80 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn quota_on_a_real_api_server() {
    quota::namespace_totals().await;
}

/// Caps at admission (issue 22, formerly caps.sh): scope, merge, the tenant and the record, the operator down, the
/// webhook's pod-create latency (~60 s with GPUBUDGET_E2E_CAPS_N=200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn caps_on_a_real_api_server() {
    caps::caps_at_admission().await;
}

/// A tenant who cannot stall the operator (issue 32, formerly hostile-caps.sh): the eviction check's latency idle
/// and while 4 loops send 1.5 MB dry-run creates through the caps webhook; every check allowed (~60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn hostile_caps_on_a_real_api_server() {
    hostile_caps::hostile_tenant().await;
}

/// No exemption a tenant can grant itself (issue 33, formerly tenant.sh): critical priority, a PodDisruptionBudget
/// under GPU memory pressure and a label into a looser cluster budget buy nothing (~40 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn tenant_no_exemption_on_a_real_api_server() {
    tenant::no_exemption().await;
}

/// Budgets on declared shares (issue 44, formerly shares.sh): KAI gpu-fraction, HAMi gpumem and MPS replicas as
/// each pod's limit: caps at admission, records, events, evictions, status, why/top, the smallest limit with
/// shares, the Node's MPS labels read by a running agent (~80 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn shares_on_a_real_api_server() {
    shares::declared().await;
}

/// Shares that hold against the tenant (issue 51, formerly shares-tenant.sh): a tenant with `edit` tries each
/// door to its share (a Binding of its own, annotate after binding, remove, num-devices, gpu-memory, pods/status,
/// create with nodeName) and is refused; HAMi's gpumem as stored; an exempt rewrite ignored by the agent (~60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn shares_tenant_on_a_real_api_server() {
    shares_tenant::doors().await;
}

/// Records through every door (issue 43, formerly records-doors.sh): the chart's records policies refuse forged
/// records through pods/status, pods/binding and bindings, the kubelet's and the agent's writes pass; a second
/// release's helm install refused; another install's policies told on the agent's Node (~50 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn records_doors_on_a_real_api_server() {
    records_doors::through_every_door().await;
}

/// ClusterGpuMemoryBudget (issue 23, formerly cluster-budget-rbac.sh): tenants cannot write or read it, a
/// cluster-wide viewer reads it, the agent lists and watches it, CEL refusals (~10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn cluster_budget_rbac_on_a_real_api_server() {
    rbac::cluster_budgets().await;
}

/// ClusterGpuMemoryQuota (issue 23, formerly quota-rbac.sh): tenants cannot write or read it nor its status, the
/// operator writes its status and evicts, never its spec, CEL refusals (~10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn quota_rbac_on_a_real_api_server() {
    rbac::quotas().await;
}

/// The chart's lifecycle with Helm itself (issue 24, formerly lifecycle.sh): install → upgrade → rollback →
/// uninstall while budgets are enforced; the rollouts mid-grace and mid-overLimitSeconds evict each pod once and
/// none early; uninstall leaves no admission or RBAC object, and the CRD, budgets, status and records stay
/// (`GPUBUDGET_E2E_FROM=<dir>`: from an older release's bin/ and chart/; ~60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn lifecycle_on_a_real_api_server() {
    lifecycle::chart_lifecycle().await;
}

/// `kubectl gpubudget` (formerly kubectl-plugin.sh): found by kubectl on PATH, run as a tenant with `edit` before
/// and after the chart's budgets-view ClusterRole, and as the admin, on budgets, records, events and a gone pod's
/// status.lastEviction written by hand; `GPUBUDGET_E2E_TRANSCRIPT=<file>` writes what it printed (~10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn kubectl_plugin_on_a_real_api_server() {
    kubectl_plugin::tenant_and_admin().await;
}

/// The agent's footprint (a measurement, not a pass/fail story; formerly scale.sh): 1 000 budgets, then an agent
/// started fresh with 110 and with 1 000 pods on its node: RSS, connections, time to every record, watch bytes,
/// table rebuilds, idle CPU; options in scale.rs and e2e/apiserver/README.md (~3 min at the default sizes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = how!()]
async fn scale_agent_on_a_real_api_server() {
    scale::agent().await;
}

/// The operator at 10 000 pods and 1 000 budgets (a measurement, not a pass/fail story; formerly
/// scale-operator.sh): time to /ready and to every status, RSS, idle status writes, record → status p50/p99;
/// options in scale.rs and e2e/apiserver/README.md (~5 min at the default sizes).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = how!()]
async fn scale_operator_on_a_real_api_server() {
    scale::operator().await;
}

/// The message of a run without the switch says how to run the tier, naming files that exist.
#[test]
fn the_not_asked_message_says_how_to_run_it() {
    let message = harness::not_asked_message();
    assert!(message.contains("GPUBUDGET_E2E_APISERVER=1"), "{message}");
    assert!(message.contains("--ignored"), "{message}");
    let readme = "e2e/apiserver/README.md";
    assert!(message.contains(readme), "the message does not name {readme}: {message}");
    assert!(harness::repo().join(readme).is_file(), "{readme}, named by the message, does not exist");
}
