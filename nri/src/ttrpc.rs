//! ttrpc: the unary subset NRI uses, over one logical connection of the [mux](crate::mux).
//!
//! A message is a 10-byte header — data length (`u32`), stream id (`u32`), type (`u8`), flags (`u8`), integers
//! big-endian — and the data. A call is a [`Request`] message on a fresh odd stream id (the client's), answered by
//! one [`Response`] message on the same id. Errors travel as a `google.rpc.Status` in the response.

use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::Error;

/// The length of a message header.
pub const HEADER_LEN: usize = 10;
/// The largest message data ttrpc accepts (4 MiB); a longer one is rejected before it is buffered.
pub const MAX_DATA: usize = 4 << 20;

/// The message type that starts a stream.
pub const TYPE_REQUEST: u8 = 1;
/// The message type that ends a stream.
pub const TYPE_RESPONSE: u8 = 2;
/// Stream data (streaming calls only, which NRI does not use).
pub const TYPE_DATA: u8 = 3;

/// One ttrpc message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Odd for client-initiated streams, which are all streams ttrpc has.
    pub stream_id: u32,
    /// One of the `TYPE_*` constants.
    pub kind: u8,
    /// Type-specific flags; zero for unary calls.
    pub flags: u8,
    /// The encoded [`Request`] or [`Response`].
    pub data: Bytes,
}

impl Message {
    /// The message on the wire, header and data.
    ///
    /// # Panics
    /// If the data is longer than [`MAX_DATA`]: callers check first (see [`check_len`]).
    pub fn encode(&self) -> Vec<u8> {
        let len = u32::try_from(self.data.len()).ok().filter(|&l| l as usize <= MAX_DATA).expect("checked length");
        let mut out = Vec::with_capacity(HEADER_LEN + self.data.len());
        out.put_u32(len);
        out.put_u32(self.stream_id);
        out.put_u8(self.kind);
        out.put_u8(self.flags);
        out.put_slice(&self.data);
        out
    }

    /// Takes one complete message off the front of a logical connection's bytes, or `None` when they hold only
    /// part of one. The announced length is checked against [`MAX_DATA`] before `src` grows to hold it.
    pub fn decode(src: &mut BytesMut) -> Result<Option<Message>, Error> {
        let Some(header) = src.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let stream_id = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
        let (kind, flags) = (header[8], header[9]);
        check_len(len)?;
        if src.len() < HEADER_LEN + len {
            src.reserve(HEADER_LEN + len - src.len());
            return Ok(None);
        }
        src.advance(HEADER_LEN);
        Ok(Some(Message { stream_id, kind, flags, data: src.split_to(len).freeze() }))
    }
}

/// Fails when `len` bytes of data exceed what one ttrpc message may carry.
pub fn check_len(len: usize) -> Result<(), Error> {
    if len > MAX_DATA { Err(Error::MessageTooLarge { len, max: MAX_DATA }) } else { Ok(()) }
}

/// A call: which method of which service, with the encoded request message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Request {
    /// The fully qualified service name, e.g. `nri.pkg.api.v1alpha1.Plugin`.
    #[prost(string, tag = "1")]
    pub service: String,
    /// The method name, e.g. `CreateContainer`.
    #[prost(string, tag = "2")]
    pub method: String,
    /// The encoded request message.
    #[prost(bytes = "bytes", tag = "3")]
    pub payload: Bytes,
    /// The caller's deadline, relative, in nanoseconds (0: none).
    #[prost(int64, tag = "4")]
    pub timeout_nano: i64,
    /// Call metadata.
    #[prost(message, repeated, tag = "5")]
    pub metadata: Vec<KeyValue>,
}

/// The answer to a call: a status and, when it is OK, the encoded response message.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Response {
    /// Absent or code 0: success.
    #[prost(message, optional, tag = "1")]
    pub status: Option<Status>,
    /// The encoded response message.
    #[prost(bytes = "bytes", tag = "2")]
    pub payload: Bytes,
}

/// A metadata entry.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    /// The key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `google.rpc.Status` (its `details` are not read).
#[derive(Clone, PartialEq, Eq, prost::Message)]
pub struct Status {
    /// A gRPC status code ([`Code`]).
    #[prost(int32, tag = "1")]
    pub code: i32,
    /// The error text.
    #[prost(string, tag = "2")]
    pub message: String,
}

impl Status {
    /// A status with the given code and text.
    pub fn new(code: Code, message: impl Into<String>) -> Status {
        Status { code: code as i32, message: message.into() }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "code {}: {}", self.code, self.message)
    }
}

/// The gRPC status codes this crate sends or tests for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Code {
    /// Success.
    Ok = 0,
    /// What Go's ttrpc server sends for a handler's plain error.
    Unknown = 2,
    /// The request could not be decoded.
    InvalidArgument = 3,
    /// The plugin refuses the operation (a `create_container` refusal).
    PermissionDenied = 7,
    /// A message too large for ttrpc.
    ResourceExhausted = 8,
    /// No such service or method. The runtime then falls back to `StateChange` for lifecycle events.
    Unimplemented = 12,
    /// The plugin failed.
    Internal = 13,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn header_layout_matches_the_protocol() {
        let msg = Message { stream_id: 3, kind: TYPE_RESPONSE, flags: 0, data: Bytes::from_static(b"xy") };
        assert_eq!(msg.encode(), [0, 0, 0, 2, 0, 0, 0, 3, 2, 0, b'x', b'y']);
    }

    #[test]
    fn a_message_split_at_every_byte_boundary_decodes_once() {
        let msg = Message { stream_id: 7, kind: TYPE_REQUEST, flags: 0, data: Bytes::from_static(b"payload") };
        let wire = msg.encode();
        for cut in 0..wire.len() {
            let mut src = BytesMut::from(&wire[..cut]);
            assert_eq!(Message::decode(&mut src).unwrap(), None, "cut at {cut}");
            src.extend_from_slice(&wire[cut..]);
            assert_eq!(Message::decode(&mut src).unwrap(), Some(msg.clone()));
            assert!(src.is_empty());
        }
    }

    #[test]
    fn oversized_message_is_refused_before_allocating() {
        let mut src = BytesMut::from(&[0x00, 0x40, 0x00, 0x01, 0, 0, 0, 1, 1, 0][..]);
        assert_eq!(Message::decode(&mut src).unwrap_err().label(), "message_too_large");
        assert!(src.capacity() < 1024);
    }

    #[test]
    fn request_and_status_field_numbers() {
        // Field 1 (service) and 2 (method) as length-delimited strings, 4 (timeout_nano) as a varint.
        let req = Request { service: "s".into(), method: "m".into(), timeout_nano: 5, ..Default::default() };
        assert_eq!(req.encode_to_vec(), [0x0a, 1, b's', 0x12, 1, b'm', 0x20, 5]);
        let rsp = Response { status: Some(Status::new(Code::PermissionDenied, "no")), payload: Bytes::new() };
        assert_eq!(rsp.encode_to_vec(), [0x0a, 6, 0x08, 7, 0x12, 2, b'n', b'o']);
    }
}
