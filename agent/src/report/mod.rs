//! Stage 5: what the agent exports about each tick ([`metrics`]).

pub mod metrics;
