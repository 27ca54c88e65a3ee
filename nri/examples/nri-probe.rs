//! A probe NRI plugin: registers as `gpubudget-probe` (index 10), subscribes to CreateContainer, adds
//! `GPUBUDGET_NRI_PROBE=<container name>` to every container and logs each request with its handling time (µs)
//! on stderr. With `NRI_PROBE_REFUSE=<reason>` in its environment it refuses every creation instead.
//!
//!     cargo build -p gpubudget-nri --example nri-probe
//!     sudo target/debug/examples/nri-probe [SOCKET]    # default /var/run/nri/nri.sock

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use gpubudget_nri::api::{ConfigureRequest, Container, ContainerAdjustment, Event, EventMask, PodSandbox};
use gpubudget_nri::{Backoff, Plugin};

#[derive(Debug)]
struct Probe {
    refuse: Option<String>,
}

impl Plugin for Probe {
    async fn configure(&self, req: ConfigureRequest) -> EventMask {
        eprintln!(
            "configure: runtime {} {} (NRI {}), registration timeout {} ms, request timeout {} ms",
            req.runtime_name, req.runtime_version, req.nri_version, req.registration_timeout, req.request_timeout
        );
        EventMask::of(&[Event::CreateContainer])
    }

    async fn synchronize(
        &self,
        pods: Vec<PodSandbox>,
        containers: Vec<Container>,
    ) -> Vec<gpubudget_nri::api::ContainerUpdate> {
        eprintln!("synchronize: {} pods, {} containers", pods.len(), containers.len());
        Vec::new()
    }

    async fn create_container(&self, pod: PodSandbox, container: Container) -> Result<ContainerAdjustment, String> {
        let started = Instant::now();
        let result = match &self.refuse {
            Some(reason) => Err(reason.clone()),
            None => {
                let mut adjust = ContainerAdjustment::default();
                adjust.add_env("GPUBUDGET_NRI_PROBE", container.name.clone());
                Ok(adjust)
            }
        };
        eprintln!(
            "create_container {}/{} container {} ({}): {} in {} µs",
            pod.namespace,
            pod.name,
            container.name,
            container.id,
            if result.is_ok() { "adjusted" } else { "refused" },
            started.elapsed().as_micros()
        );
        result
    }
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(false).init();
    let socket = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "/var/run/nri/nri.sock".into()));
    let probe = Arc::new(Probe { refuse: std::env::var("NRI_PROBE_REFUSE").ok() });
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    gpubudget_nri::run_forever(&socket, "gpubudget-probe", "10", probe, Backoff::default(), shutdown).await;
}
