//! The admin port: `/live` (the process serves), `/ready` (every readiness check passes), `/metrics`
//! (Prometheus text format from a prometheus-client registry).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// `{check}` of the readiness gauge.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CheckLabels {
    check: String,
}

/// Named readiness checks. `/ready` answers 200 only when every registered check is true; the body
/// lists each check, so a failing probe says why. The same checks are a gauge for `/metrics`
/// ([`Health::register`]), so an alert sees a component that serves but is not ready.
#[derive(Debug, Clone, Default)]
pub struct Health {
    checks: Arc<Mutex<BTreeMap<&'static str, bool>>>,
    gauge: Family<CheckLabels, Gauge>,
}

impl Health {
    /// Registers checks, all false until set.
    pub fn new(checks: &[&'static str]) -> Self {
        let health = Self::default();
        for check in checks {
            health.set(check, false);
        }
        health
    }

    /// Sets one check.
    pub fn set(&self, check: &'static str, ok: bool) {
        if let Ok(mut checks) = self.checks.lock() {
            checks.insert(check, ok);
        }
        self.gauge.get_or_create(&CheckLabels { check: check.to_owned() }).set(i64::from(ok));
    }

    /// Registers the checks as the gauge `name{check}` (1 while the check passes, else 0) in `registry`.
    pub fn register(&self, registry: &mut Registry, name: &str) {
        registry.register(
            name,
            "1 while a readiness check passes, else 0 (/ready answers 200 when all do)",
            self.gauge.clone(),
        );
    }

    /// Whether every check passes.
    pub fn is_ready(&self) -> bool {
        self.checks.lock().map(|c| c.values().all(|ok| *ok)).unwrap_or(false)
    }

    /// One line per check: `name ok` or `name not ready`.
    pub fn report(&self) -> String {
        self.checks
            .lock()
            .map(|c| c.iter().map(|(k, ok)| format!("{k} {}\n", if *ok { "ok" } else { "not ready" })).collect())
            .unwrap_or_default()
    }
}

#[derive(Clone)]
struct AdminState {
    health: Health,
    registry: Arc<Registry>,
}

async fn live() -> &'static str {
    "live\n"
}

async fn ready(State(state): State<AdminState>) -> impl IntoResponse {
    let code = if state.health.is_ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, state.health.report())
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            body,
        ),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, [(header::CONTENT_TYPE, "text/plain")], String::new()),
    }
}

/// The admin router (exposed for tests).
pub fn router(health: Health, registry: Arc<Registry>) -> Router {
    Router::new()
        .route("/live", get(live))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(AdminState { health, registry })
}

/// Serves the admin port until `shutdown` is cancelled.
pub async fn serve_admin(
    addr: SocketAddr,
    health: Health,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "admin port serving /live /ready /metrics");
    axum::serve(listener, router(health, registry)).with_graceful_shutdown(shutdown.cancelled_owned()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn fetch(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connects");
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("writes");
        let mut out = String::new();
        stream.read_to_string(&mut out).await.expect("reads");
        out
    }

    #[tokio::test]
    async fn serves_probes_and_metrics_until_shutdown() {
        let health = Health::new(&["caches", "nvml"]);
        let mut registry = Registry::default();
        let counter = Counter::<u64>::default();
        registry.register("demo_things", "Things", counter.clone());
        counter.inc_by(3);
        health.register(&mut registry, "demo_ready");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("addr");
        let shutdown = CancellationToken::new();
        let app = router(health.clone(), Arc::new(registry));
        let server = tokio::spawn(
            axum::serve(listener, app).with_graceful_shutdown(shutdown.clone().cancelled_owned()).into_future(),
        );

        assert!(fetch(addr, "/live").await.starts_with("HTTP/1.1 200"));
        let not_ready = fetch(addr, "/ready").await;
        assert!(not_ready.starts_with("HTTP/1.1 503"), "{not_ready}");
        assert!(not_ready.contains("caches not ready"));
        let metrics = fetch(addr, "/metrics").await;
        assert!(metrics.contains("demo_ready{check=\"caches\"} 0"), "{metrics}");
        health.set("caches", true);
        health.set("nvml", true);
        let ready = fetch(addr, "/ready").await;
        assert!(ready.starts_with("HTTP/1.1 200") && ready.contains("nvml ok"), "{ready}");
        let metrics = fetch(addr, "/metrics").await;
        assert!(metrics.contains("demo_things_total 3"), "{metrics}");
        assert!(metrics.contains("demo_ready{check=\"caches\"} 1"), "{metrics}");
        assert!(metrics.contains("demo_ready{check=\"nvml\"} 1"), "{metrics}");

        shutdown.cancel();
        server.await.expect("joins").expect("serves cleanly");
    }
}
