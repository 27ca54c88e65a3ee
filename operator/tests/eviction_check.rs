//! The eviction check served over HTTP(S), looking pods up in the in-memory API.

use std::time::Duration;

use gpubudget_operator::eviction_check::{self, NODE_NAME_EXTRA, PATH, PodLookup};
use gpubudget_testkit::FakeApi;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

fn review(pod: &str, node: Option<&str>) -> Value {
    let extra = node.map_or(json!({}), |n| json!({ NODE_NAME_EXTRA: [n] }));
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "policy", "version": "v1", "kind": "Eviction"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "eviction",
            "name": pod,
            "namespace": "team-a",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:gpubudget:gpubudget-agent", "extra": extra},
            "object": {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": "team-a"}},
            "dryRun": false
        }
    })
}

async fn post(addr: std::net::SocketAddr, body: &Value) -> Value {
    let body = body.to_string();
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let request = format!(
        "POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("writes");
    let mut out = String::new();
    stream.read_to_string(&mut out).await.expect("reads");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    let json = out.split("\r\n\r\n").nth(1).expect("a body");
    serde_json::from_str(json).expect("json")
}

fn cluster() -> FakeApi {
    let fake = FakeApi::new();
    for (name, node) in [("on-gpu-1", "gpu-1"), ("on-gpu-2", "gpu-2")] {
        fake.put_object(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team-a"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]},
        }))
        .expect("stored");
    }
    fake
}

#[tokio::test]
async fn allows_only_evictions_of_the_agents_own_node() {
    let fake = cluster();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(eviction_check::serve_on(
        listener,
        None,
        eviction_check::router(PodLookup::new(fake.client())),
        shutdown.clone(),
    ));

    let ok = post(addr, &review("on-gpu-1", Some("gpu-1"))).await;
    assert_eq!(ok["response"]["allowed"], true, "{ok}");
    assert_eq!(ok["response"]["uid"], "u-1");
    let denied = post(addr, &review("on-gpu-2", Some("gpu-1"))).await;
    assert_eq!(denied["response"]["allowed"], false);
    assert_eq!(denied["response"]["status"]["code"], 403);
    let message = denied["response"]["status"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("runs on node gpu-2"), "{message}");
    let missing = post(addr, &review("nope", Some("gpu-1"))).await;
    assert_eq!(missing["response"]["allowed"], false);
    let unbound = post(addr, &review("on-gpu-1", None)).await;
    assert_eq!(unbound["response"]["allowed"], false);

    shutdown.cancel();
    server.await.expect("joins").expect("serves cleanly");
}

/// TLS with a certificate made by `openssl` (skipped where there is none), checked with `curl`.
#[tokio::test]
async fn serves_https_with_the_mounted_certificate() {
    let runs =
        |tool: &str, arg: &str| std::process::Command::new(tool).arg(arg).output().is_ok_and(|o| o.status.success());
    if !runs("openssl", "version") || !runs("curl", "--version") {
        eprintln!("skipped: needs openssl and curl");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let made = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .arg("-keyout")
        .arg(dir.path().join("tls.key"))
        .arg("-out")
        .arg(dir.path().join("tls.crt"))
        .output()
        .expect("openssl runs");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    // Then an RSA key in PKCS#1 ("RSA PRIVATE KEY"), the form Helm's genSignedCert writes.
    let rsa = std::process::Command::new("sh")
        .arg("-c")
        .arg(
            "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost \
             -addext subjectAltName=DNS:localhost -keyout rsa8.key -out rsa.crt 2>/dev/null \
             && openssl rsa -in rsa8.key -out rsa.key -traditional 2>/dev/null && grep -q 'BEGIN RSA PRIVATE KEY' rsa.key",
        )
        .current_dir(dir.path())
        .status()
        .expect("openssl runs");
    assert!(rsa.success());

    eviction_check::install_crypto_provider();
    let fake = cluster();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(eviction_check::serve_on_with(
        listener,
        Some(dir.path().to_owned()),
        eviction_check::router(PodLookup::new(fake.client())),
        shutdown.clone(),
        Duration::from_millis(200),
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let body = review("on-gpu-2", Some("gpu-1")).to_string();
    let url = format!("https://localhost:{}{PATH}", addr.port());
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--cacert"])
        .arg(dir.path().join("tls.crt"))
        .args(["--resolve", &format!("localhost:{}:127.0.0.1", addr.port())])
        .args(["-H", "Content-Type: application/json", "--data", &body, &url])
        .output()
        .await
        .expect("curl runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let answer: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(answer["response"]["allowed"], false, "{answer}");

    // The Secret is renewed in place (here with the RSA pair): picked up without a restart.
    std::fs::rename(dir.path().join("rsa.crt"), dir.path().join("tls.crt")).expect("renames");
    std::fs::rename(dir.path().join("rsa.key"), dir.path().join("tls.key")).expect("renames");
    let reloaded = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let out = tokio::process::Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "echo | openssl s_client -connect 127.0.0.1:{} -servername localhost 2>/dev/null | openssl x509 -noout -text",
                    addr.port()
                ))
                .output()
                .await
                .expect("openssl runs");
            if String::from_utf8_lossy(&out.stdout).contains("rsaEncryption") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    assert!(reloaded.is_ok(), "the renewed certificate was not served");

    shutdown.cancel();
    server.await.expect("joins").expect("serves cleanly");
}
