//! What both gpubudget binaries run on: one shutdown signal shared by every task, logging, and the
//! admin port serving `/live`, `/ready` and `/metrics`.

pub mod admin;
pub mod shutdown;
pub mod telemetry;

pub use admin::{Health, serve_admin};

#[doc(hidden)]
pub use prometheus_client as __prometheus_client;

/// Implements prometheus-client's `EncodeLabelValue` for types that name a closed set of label values, each
/// exported as its `as_str(self) -> &'static str` (the values dashboards and alerts read). prometheus-client's own
/// derive writes a variant's name as it is spelt (`Accepted`); gpubudget's label values are lowercase
/// (`accepted`), so they are written once, in `as_str`.
#[macro_export]
macro_rules! label_values {
    ($($t:ty),* $(,)?) => {$(
        impl $crate::__prometheus_client::encoding::EncodeLabelValue for $t {
            fn encode(
                &self,
                encoder: &mut $crate::__prometheus_client::encoding::LabelValueEncoder<'_>,
            ) -> ::core::result::Result<(), ::core::fmt::Error> {
                ::core::fmt::Write::write_str(encoder, self.as_str())
            }
        }
    )*};
}
pub use shutdown::shutdown_on_signal;
pub use telemetry::{LogFormat, init_tracing, init_tracing_with};
