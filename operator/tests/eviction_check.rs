//! The eviction check served over HTTP(S), looking pods up in the in-memory API.

use std::net::SocketAddr;
use std::time::Duration;

use gpubudget_operator::eviction_check::{self, CERT_REFRESH, NODE_NAME_EXTRA, PATH, PodLookup};
use gpubudget_testkit::FakeApi;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;
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

async fn post(addr: SocketAddr, body: &Value) -> Value {
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

/// A request that keeps its connection alive.
fn keep_alive_request(body: &Value) -> String {
    let body = body.to_string();
    format!(
        "POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Reads one response (its head, lower-cased, and its JSON body of Content-Length bytes) from a connection that
/// may stay open.
async fn read_response(stream: &mut tokio::net::TcpStream) -> (String, Value) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = stream.read(&mut byte).await.expect("reads");
        assert_eq!(n, 1, "the connection closed before the answer's head ended: {}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).expect("utf-8").to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .expect("a content-length")
        .trim()
        .parse()
        .expect("a length");
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await.expect("reads the body");
    (head, serde_json::from_slice(&body).expect("json"))
}

/// Serves the check over plain HTTP for `fake`'s pods on a free port, answering for `drain` after the signal.
async fn serve_plain(
    fake: &FakeApi,
    drain: Duration,
) -> (SocketAddr, CancellationToken, JoinHandle<anyhow::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("addr");
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(eviction_check::serve_on_with(
        listener,
        None,
        eviction_check::router(PodLookup::new(fake.client())),
        shutdown.clone(),
        CERT_REFRESH,
        drain,
    ));
    (addr, shutdown, server)
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
    let (addr, shutdown, server) = serve_plain(&fake, Duration::ZERO).await;

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
        Duration::ZERO,
    ));
    // No wait for the server: the listener is bound, so curl's connection waits in its backlog until the
    // server task (run while this one awaits curl) accepts it.
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
            // A wall-clock wait, and it must be: the probe is a separate process (openssl) on a real socket,
            // and the reload follows the files' mtime, checked on the server's 200 ms timer; a paused tokio
            // clock would race ahead of both.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    assert!(reloaded.is_ok(), "the renewed certificate was not served");

    shutdown.cancel();
    server.await.expect("joins").expect("serves cleanly");
}

/// After the shutdown signal (a rollout, a drain) the check keeps answering for its drain, on the connections the
/// API server keeps alive and on new ones, and each answer then closes its connection; before the signal,
/// connections stay open. (Closing an idle kept-alive connection instead fails a request sent on it at that
/// moment: an `EOF` the API server turns into a refused eviction with `failurePolicy: Fail`.)
#[tokio::test]
async fn answers_through_the_drain_closing_each_connection() {
    let fake = cluster();
    let (addr, shutdown, server) = serve_plain(&fake, Duration::from_secs(3600)).await;

    let mut kept = tokio::net::TcpStream::connect(addr).await.expect("connects");
    kept.write_all(keep_alive_request(&review("on-gpu-1", Some("gpu-1"))).as_bytes()).await.expect("writes");
    let (head, answer) = read_response(&mut kept).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("connection: close"), "closed before any shutdown: {head}");
    assert_eq!(answer["response"]["allowed"], true, "{answer}");

    shutdown.cancel();
    kept.write_all(keep_alive_request(&review("on-gpu-2", Some("gpu-1"))).as_bytes()).await.expect("writes");
    let (head, answer) = read_response(&mut kept).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("connection: close"), "a draining answer keeps its connection: {head}");
    assert_eq!(answer["response"]["allowed"], false, "{answer}");
    let mut rest = Vec::new();
    assert_eq!(kept.read_to_end(&mut rest).await.expect("reads"), 0, "the connection stays open after its answer");

    let fresh = post(addr, &review("on-gpu-1", Some("gpu-1"))).await;
    assert_eq!(fresh["response"]["allowed"], true, "a new connection during the drain: {fresh}");
    assert!(!server.is_finished(), "the check stopped before its drain ended");
    server.abort();
}
