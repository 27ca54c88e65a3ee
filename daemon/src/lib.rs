//! What both gpubudget binaries run on: one shutdown signal shared by every task, logging, and the
//! admin port serving `/live`, `/ready` and `/metrics`.

pub mod admin;
pub mod shutdown;
pub mod telemetry;

pub use admin::{Health, serve_admin};
pub use shutdown::shutdown_on_signal;
pub use telemetry::{LogFormat, init_tracing, init_tracing_with};
