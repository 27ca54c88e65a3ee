//! Stage 5: what the agent exports about each tick ([`metrics`]), and what `top` shows of a sample ([`top`]).

pub mod metrics;
pub mod top;
