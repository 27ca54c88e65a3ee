#!/usr/bin/env python3
"""Load for the scale runs against a real kube-apiserver (scale.sh, scale-operator.sh): creates budgets and
pods many at a time, measures record -> status latency, and streams budget writes. Standard library only.

The API server and the admin's token come from the environment: GPUBUDGET_API (https://host:port) and
GPUBUDGET_TOKEN. Certificates are not verified (a local test control plane).

    load.py budgets PREFIX NAMESPACES PER_NS [LIMIT]     budget-<b> in PREFIX-<n>; budget-0 selects every pod
    load.py pods PREFIX NAMESPACES PER_NS PER_BUDGET_NS NODES [--records] [--missing]
    load.py record-latency PREFIX NAMESPACES PER_NS PER_BUDGET_NS CHANGES
    load.py stream status|spec NAMES_FILE RATE SECONDS       NAMES_FILE: namespace/name lines
    load.py edit-all NAMES_FILE SPEC_JSON                     every budget's spec merge-patched at once
    load.py status-ceiling PREFIX NAMESPACES PER_NS apply|apply-events|merge|clear THREADS
                                                              every budget's status rewritten once, no operator
    load.py list-ceiling                                      what the operator lists before a status, timed
"""
import http.client
import json
import os
import ssl
import statistics
import sys
import threading
import time
import urllib.parse

GI = 1 << 30
THREADS = 8
_local = threading.local()


def conn():
    c = getattr(_local, "conn", None)
    if c is None:
        url = urllib.parse.urlparse(os.environ["GPUBUDGET_API"])
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        c = http.client.HTTPSConnection(url.hostname, url.port, context=ctx, timeout=60)
        _local.conn = c
    return c


def request(method, path, body=None, content_type="application/json"):
    headers = {"Authorization": "Bearer " + os.environ["GPUBUDGET_TOKEN"], "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = content_type
    for attempt in range(5):
        try:
            c = conn()
            c.request(method, path, body=data, headers=headers)
            r = c.getresponse()
            payload = r.read()
            if r.status == 429 or r.status >= 500:
                time.sleep(0.2 * (attempt + 1))
                continue
            if r.status >= 400:
                raise RuntimeError(f"{method} {path}: {r.status} {payload[:300]!r}")
            return json.loads(payload) if payload else None
        except (http.client.HTTPException, OSError):
            _local.conn = None
            time.sleep(0.2 * (attempt + 1))
    raise RuntimeError(f"{method} {path}: gave up")


def parallel(jobs):
    """Runs the callables of `jobs` on THREADS threads; raises the first error."""
    jobs = list(jobs)
    errors, lock, index = [], threading.Lock(), [0]

    def work():
        while True:
            with lock:
                if errors or index[0] >= len(jobs):
                    return
                job = jobs[index[0]]
                index[0] += 1
            try:
                job()
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def ns(prefix, n):
    return f"{prefix}-{n}"


def budget_path(namespace, name=""):
    return f"/apis/gpubudget.io/v1alpha1/namespaces/{namespace}/gpumemorybudgets" + (f"/{name}" if name else "")


def app_of(k, per_budget_ns):
    """Pod k's app label: budgets 1.. of its namespace select app-<b>; budget-0 selects every pod."""
    return f"app-{1 + k % max(1, per_budget_ns - 1)}"


def record(usage, budget, node):
    return {"gpubudget.io/state": "Within", "gpubudget.io/usage-bytes": str(usage), "gpubudget.io/budget": budget,
            "gpubudget.io/node": node}


def apply_record(namespace, name, usage, budget, node):
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "annotations": record(usage, budget, node)}}
    request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}?fieldManager=gpubudget-agent/{node}&force=true",
            body, "application/apply-patch+yaml")


def cmd_budgets(prefix, namespaces, per_ns, limit="40Gi"):
    namespaces, per_ns = int(namespaces), int(per_ns)

    def create(n, b):
        selector = {} if b == 0 else {"matchLabels": {"app": f"app-{b}"}}
        request("POST", budget_path(ns(prefix, n)), {
            "apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
            "metadata": {"name": f"budget-{b}", "namespace": ns(prefix, n)},
            "spec": {"selector": selector, "limit": "64Gi" if b == 0 else limit, "evictionGracePeriodSeconds": 30}})

    t0 = time.monotonic()
    parallel(lambda n=n, b=b: create(n, b) for n in range(namespaces) for b in range(per_ns))
    print(f"{namespaces * per_ns} budgets created in {time.monotonic() - t0:.1f} s")


def cmd_pods(prefix, namespaces, per_ns, per_budget_ns, nodes, *flags):
    """Pods (and their records with --records); with --missing, only those not there (a kept population
    after pods were lost)."""
    namespaces, per_ns, per_budget_ns, nodes = int(namespaces), int(per_ns), int(per_budget_ns), int(nodes)
    records = "--records" in flags
    last_applied = "x" * 1500
    present = set()
    if "--missing" in flags:
        def listed(n):
            def job():
                names = {p["metadata"]["name"] for p in request("GET", f"/api/v1/namespaces/{ns(prefix, n)}/pods")["items"]}
                with lock:
                    present.update((n, name) for name in names)
            return job
        lock = threading.Lock()
        parallel(listed(n) for n in range(namespaces))

    def create(n, k):
        if (n, f"pod-{k:05}") in present:
            return
        namespace, name, node = ns(prefix, n), f"pod-{k:05}", f"{prefix}-node-{(n * per_ns + k) % nodes}"
        app = app_of(k, per_budget_ns)
        request("POST", f"/api/v1/namespaces/{namespace}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": namespace,
                "labels": {"app": app, "team": namespace, "tier": "inference", "version": "v1.2.3",
                           "pod-template-hash": "5d8f7c9b6", "app.kubernetes.io/managed-by": "helm"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": last_applied,
                                "prometheus.io/scrape": "true"},
            },
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 30,
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}})
        if records:
            apply_record(namespace, name, (1 + k % 6) * GI, app.replace("app-", "budget-"), node)

    t0 = time.monotonic()
    parallel(lambda n=n, k=k: create(n, k) for n in range(namespaces) for k in range(per_ns))
    print(f"{namespaces * per_ns - len(present)} pods created{' with records' if records else ''} in "
          f"{time.monotonic() - t0:.1f} s" + (f" ({len(present)} were there)" if present else ""))


def percentile(samples, q):
    s = sorted(samples)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def cmd_record_latency(prefix, namespaces, per_ns, per_budget_ns, changes):
    """A new, highest usage on one pod (the agent's record, applied as the agent applies it) until its
    budget's status.topPods[0] shows it: polled every 2 ms."""
    namespaces, per_ns, per_budget_ns, changes = int(namespaces), int(per_ns), int(per_budget_ns), int(changes)
    samples = []
    for c in range(changes):
        i = (c * 7919) % (namespaces * per_ns)
        n, k = i // per_ns, i % per_ns
        budget = app_of(k, per_budget_ns).replace("app-", "budget-")
        # Above every other pod's usage, and above what an earlier run over kept objects wrote (a record
        # applied again unchanged is no change at all, and its status would show it at once).
        usage = 7 * GI + (int(time.time()) % 1_000_000) * 1000 + c
        t0 = time.monotonic()
        apply_record(ns(prefix, n), f"pod-{k:05}", usage, budget, f"{prefix}-node-0")
        while True:
            status = (request("GET", budget_path(ns(prefix, n), budget)) or {}).get("status", {})
            top = status.get("topPods") or [{}]
            if top[0].get("usageBytes") == usage:
                break
            if time.monotonic() - t0 > 30:
                raise RuntimeError(f"change {c} never converged")
            time.sleep(0.002)
        samples.append(time.monotonic() - t0)
    ms = [s * 1e3 for s in samples]
    print(f"record -> status: n={len(ms)} p50={percentile(ms, 0.5):.1f} ms p99={percentile(ms, 0.99):.1f} ms "
          f"max={max(ms):.1f} ms mean={statistics.mean(ms):.1f} ms")


def cmd_stream(kind, names_file, rate, seconds):
    """Writes to the budgets named in NAMES_FILE (namespace/name lines), round robin, at RATE per second for
    SECONDS: `status` patches status.matchedPods (what the operator's writes look like to a watcher); `spec`
    sets spec.overLimitSeconds to a new value (a change of what is enforced)."""
    names = [line.strip().split("/") for line in open(names_file) if line.strip()]
    rate, seconds = float(rate), float(seconds)
    t0, i = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        namespace, name = names[i % len(names)]
        path = budget_path(namespace, name)
        if kind == "status":
            request("PATCH", path + "/status", {"status": {"matchedPods": 1000 + i}}, "application/merge-patch+json")
        else:
            # A value no earlier write gave (a write that changes nothing is no event at all).
            value = 30 + int(time.time() * 1000) % 1_000_000
            request("PATCH", path, {"spec": {"overLimitSeconds": value}}, "application/merge-patch+json")
        i += 1
        wait = t0 + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    elapsed = time.monotonic() - t0
    print(f"{i} {kind} writes in {elapsed:.1f} s ({i / elapsed:.1f}/s)")


def cmd_edit_all(names_file, spec_json):
    """Merge-patches the spec of every budget named in NAMES_FILE with SPEC_JSON, THREADS writes at a time: a
    fleet-wide edit, as an admin's script or a GitOps sync of every budget would make it."""
    names = [line.strip().split("/") for line in open(names_file) if line.strip()]
    spec = json.loads(spec_json)
    t0 = time.monotonic()

    def edit(namespace, name):
        return lambda: request("PATCH", budget_path(namespace, name), {"spec": spec}, "application/merge-patch+json")

    parallel([edit(namespace, name) for namespace, name in names])
    print(f"{len(names)} budgets patched with {spec_json} in {time.monotonic() - t0:.1f} s")


def cmd_status_ceiling(prefix, namespaces, per_ns, mode, threads):
    """The API server's own rate for this CRD's status writes, without the operator: every budget's status
    (the one the operator wrote, read first, with matchedPods moved so each write is a real change) written
    once, THREADS at a time, as the operator writes it (`apply`: server-side apply as gpubudget-operator,
    forced, with the resourceVersion precondition) or as a JSON merge patch (`merge`); `clear` removes every
    status. Run with the operator stopped; prints writes per second."""
    global THREADS
    namespaces, per_ns, THREADS = int(namespaces), int(per_ns), int(threads)
    names = [(ns(prefix, n), f"budget-{b}") for n in range(namespaces) for b in range(per_ns)]
    current = {}

    def read(namespace, name):
        def job():
            obj = request("GET", budget_path(namespace, name))
            current[(namespace, name)] = (obj["metadata"]["resourceVersion"], obj.get("status") or {})
        return job

    parallel([read(namespace, name) for namespace, name in names])

    def write(namespace, name):
        rv, status = current[(namespace, name)]
        status = dict(status, matchedPods=int(status.get("matchedPods", 0)) + 1)
        path = budget_path(namespace, name) + "/status"
        if mode in ("apply", "apply-events"):
            body = {"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
                    "metadata": {"name": name, "namespace": namespace, "resourceVersion": rv}, "status": status}
            overlapping = [c for c in status.get("conditions", []) if c.get("type") == "Overlapping"
                           and c.get("status") == "True"]

            def job():
                written = request("PATCH", path + "?fieldManager=gpubudget-operator&force=true", body,
                                  "application/apply-patch+yaml")
                # `apply-events`: the Warning the operator publishes with a first status that says Overlapping
                # (status::notices), one events.k8s.io/v1 create after the status write, as its reconcile does.
                if mode == "apply-events" and overlapping:
                    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
                    event = {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                             "metadata": {"name": f"{name}.{os.urandom(8).hex()}", "namespace": namespace},
                             "eventTime": now, "reportingController": "gpubudget-operator",
                             "reportingInstance": "load.py", "action": "Reconcile", "reason": "Overlapping",
                             "type": "Warning", "note": overlapping[0].get("message", "")[:1024],
                             "regarding": {"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuMemoryBudget",
                                           "namespace": namespace, "name": name,
                                           "uid": written["metadata"]["uid"]}}
                    request("POST", f"/apis/events.k8s.io/v1/namespaces/{namespace}/events", event)
            return job
        body = {"metadata": {"resourceVersion": rv}, "status": status}
        return lambda: request("PATCH", path, body, "application/merge-patch+json")

    def clear(namespace, name):
        return lambda: request("PATCH", budget_path(namespace, name) + "/status", {"status": None},
                               "application/merge-patch+json")

    jobs = [(clear if mode == "clear" else write)(namespace, name) for namespace, name in names]
    t0 = time.monotonic()
    parallel(jobs)
    elapsed = time.monotonic() - t0
    print(f"status-ceiling mode={mode} threads={THREADS} writes={len(jobs)} seconds={elapsed:.1f} "
          f"rate={len(jobs) / elapsed:.0f}/s")


def cmd_list_ceiling():
    """The API server's own time to hand a client what the operator lists before its first status: every
    active pod (full objects, 500 a page, kube's default), and 100 a page the budgets, cluster budgets,
    namespaces, nodes' usage objects and both kinds of mirrors (metadata only for namespaces and mirrors, as the
    operator asks), all at once on one thread each, as the operator's watches start together; prints the wall
    time and the bytes."""
    global THREADS
    lists = [("/api/v1/pods", 500, "fieldSelector=status.phase%21%3DSucceeded%2Cstatus.phase%21%3DFailed", False),
             ("/apis/gpubudget.io/v1alpha1/gpumemorybudgets", 100, "", False),
             ("/apis/gpubudget.io/v1alpha1/clustergpumemorybudgets", 100, "", False),
             ("/api/v1/namespaces", 100, "", True),
             ("/apis/gpubudget.io/v1alpha1/gpunodeusages", 100, "", False),
             ("/apis/gpubudget.io/v1alpha1/gpumemorybudgetmirrors", 100, "", True),
             ("/apis/gpubudget.io/v1alpha1/clustergpumemorybudgetmirrors", 100, "", True)]
    totals = {}

    def lister(path, limit, query, meta_only):
        def job():
            items, size, token = 0, 0, ""
            while True:
                q = f"limit={limit}" + (f"&{query}" if query else "") + \
                    (f"&continue={urllib.parse.quote(token)}" if token else "")
                headers = {"Authorization": "Bearer " + os.environ["GPUBUDGET_TOKEN"],
                           "Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
                           if meta_only else "application/json"}
                c = conn()
                c.request("GET", f"{path}?{q}", headers=headers)
                r = c.getresponse()
                payload = r.read()
                if r.status >= 400:
                    raise RuntimeError(f"GET {path}: {r.status} {payload[:200]!r}")
                page = json.loads(payload)
                items, size = items + len(page.get("items") or []), size + len(payload)
                token = page.get("metadata", {}).get("continue", "")
                if not token:
                    break
            totals[path.rsplit("/", 1)[1]] = (items, size)
        return job

    THREADS = len(lists)
    t0 = time.monotonic()
    parallel(lister(*entry) for entry in lists)
    elapsed = time.monotonic() - t0
    what = " ".join(f"{k}={n}" for k, (n, _) in sorted(totals.items()))
    print(f"list-ceiling seconds={elapsed:.1f} bytes={sum(b for _, b in totals.values()) / (1 << 20):.0f}MiB {what}")


def cmd_node_usage(prefix, namespaces, nodes):
    """One GpuNodeUsage per node (#34), as the agents write them (server-side apply under the node's field
    manager): every pod of the node with its UID and a usage of its record's plus 1 GiB, so that statuses read
    from these objects show it."""
    namespaces, nodes = int(namespaces), int(nodes)
    by_node = {}
    lock = threading.Lock()

    def listed(n):
        def job():
            for p in request("GET", f"/api/v1/namespaces/{ns(prefix, n)}/pods")["items"]:
                m = p["metadata"]
                usage = int(m.get("annotations", {}).get("gpubudget.io/usage-bytes", "0")) + GI
                entry = {"namespace": m["namespace"], "name": m["name"], "uid": m["uid"], "usageBytes": usage}
                with lock:
                    by_node.setdefault(p["spec"]["nodeName"], []).append(entry)
        return job
    parallel(listed(n) for n in range(namespaces))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def write(node, pods):
        def job():
            pods.sort(key=lambda e: (-e["usageBytes"], e["namespace"], e["name"]))
            body = {"apiVersion": "gpubudget.io/v1alpha1", "kind": "GpuNodeUsage", "metadata": {"name": node},
                    "spec": {"nodeName": node, "observedAt": now, "podCount": len(pods),
                             "total": f"{sum(e['usageBytes'] for e in pods) // GI}Gi", "pods": pods}}
            request("PATCH", f"/apis/gpubudget.io/v1alpha1/gpunodeusages/{node}"
                    f"?fieldManager=gpubudget-agent/{node}&force=true", body, "application/apply-patch+yaml")
        return job
    t0 = time.monotonic()
    parallel(write(node, pods) for node, pods in by_node.items())
    print(f"{len(by_node)} GpuNodeUsage objects ({sum(len(p) for p in by_node.values())} pods) written in "
          f"{time.monotonic() - t0:.1f} s")


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    {"budgets": cmd_budgets, "pods": cmd_pods, "record-latency": cmd_record_latency, "stream": cmd_stream,
     "edit-all": cmd_edit_all, "status-ceiling": cmd_status_ceiling, "node-usage": cmd_node_usage,
     "list-ceiling": cmd_list_ceiling}[cmd](*args)


if __name__ == "__main__":
    main()
