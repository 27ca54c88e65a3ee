//! A small NRI (containerd Node Resource Interface) plugin client.
//!
//! An NRI plugin connects to the runtime's socket (`/var/run/nri/nri.sock`), multiplexes two logical
//! connections over it ([`mux`]), serves the `Plugin` ttrpc service on one and calls the `Runtime` service on the
//! other ([`ttrpc`]), with the messages of NRI's `api.proto` ([`api`]). [`plugin::run`] does all of that for a
//! [`Plugin`] implementation; it knows nothing about what the plugin decides.
//!
//! Written from the wire definitions vendored in containerd 2.3.4 (NRI v0.12.0, ttrpc v1.2.8); see README.md.

pub mod api;
mod error;
pub mod mux;
pub mod plugin;
pub mod ttrpc;

pub use error::Error;
pub use plugin::{Backoff, Plugin, run, run_forever, serve};
