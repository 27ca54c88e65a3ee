//! The one error type of this crate.

use crate::ttrpc::Status;

/// Why a plugin connection ended (or never started).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime's socket could not be connected to.
    #[error("connecting to the NRI socket {path}: {source}")]
    Connect {
        /// The socket path.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Reading from or writing to the socket failed.
    #[error("NRI socket I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The socket ended in the middle of a frame.
    #[error("NRI socket closed in the middle of a frame")]
    Truncated,
    /// A mux frame announced more payload than the mux allows.
    #[error("mux frame of {len} bytes exceeds the maximum of {max}")]
    FrameTooLarge {
        /// The announced payload length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// A ttrpc message announced more data than ttrpc allows.
    #[error("ttrpc message of {len} bytes exceeds the maximum of {max}")]
    MessageTooLarge {
        /// The announced data length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// A protobuf message could not be decoded.
    #[error("decoding {what}: {source}")]
    Decode {
        /// Which message.
        what: &'static str,
        /// The underlying error.
        source: prost::DecodeError,
    },
    /// The peer broke the ttrpc protocol (a message type or stream id that has no place where it arrived).
    #[error("ttrpc protocol violation: {0}")]
    Protocol(String),
    /// The runtime answered the registration with an error status.
    #[error("registration refused by the runtime: {0}")]
    Registration(Status),
    /// The runtime did not answer the registration in time.
    #[error("no answer to the registration within {0:?}")]
    RegistrationTimeout(std::time::Duration),
}

impl Error {
    /// A short, stable name of the variant, for metrics labels and structured logs.
    pub fn label(&self) -> &'static str {
        match self {
            Error::Connect { .. } => "connect",
            Error::Io(_) => "io",
            Error::Truncated => "truncated",
            Error::FrameTooLarge { .. } => "frame_too_large",
            Error::MessageTooLarge { .. } => "message_too_large",
            Error::Decode { .. } => "decode",
            Error::Protocol(_) => "protocol",
            Error::Registration(_) => "registration_refused",
            Error::RegistrationTimeout(_) => "registration_timeout",
        }
    }
}
