//! NRI's connection multiplexing: several logical byte streams over the one socket.
//!
//! Every frame is an 8-byte header — the logical connection id and the payload length, both big-endian `u32` —
//! followed by the payload. A logical connection is a plain byte stream: a ttrpc message may span frames and a
//! frame may hold parts of several messages. The plugin serves its `Plugin` service on [`PLUGIN_SERVICE_CONN`]
//! (the runtime is the ttrpc client there) and calls the runtime's `Runtime` service on [`RUNTIME_SERVICE_CONN`].
//! Frames for any other connection id are dropped, as NRI's own mux does.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::{Error, ttrpc};

/// A logical connection id.
pub type ConnId = u32;
/// The logical connection on which the plugin serves the `Plugin` service.
pub const PLUGIN_SERVICE_CONN: ConnId = 1;
/// The logical connection on which the plugin calls the runtime's `Runtime` service.
pub const RUNTIME_SERVICE_CONN: ConnId = 2;
/// The length of a frame header.
pub const HEADER_LEN: usize = 8;
/// The largest payload NRI's mux writes in one frame (a whole ttrpc message of maximum size); larger ones are
/// rejected before anything is allocated for them.
pub const MAX_PAYLOAD: usize = ttrpc::HEADER_LEN + ttrpc::MAX_DATA;
/// The first frame of a message carries at most this many bytes.
///
/// NRI's mux hands each frame whole to a `Read` call and fails it (ENOMEM) when the caller's buffer is smaller
/// than the frame. The runtime reads through Go's 4096-byte `bufio.Reader`, which calls `Read` only when empty,
/// with its whole buffer or with a caller's slice of at least 4096 bytes. So: the first frame of a message (read
/// into the bufio buffer, along with the message header) is at most 4096 bytes, and the rest of the message goes
/// in one frame (read straight into the message buffer, which is exactly that long), as Go's own writer does.
pub const FIRST_FRAME_MAX: usize = 4096;

/// One frame as read from the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The logical connection it belongs to.
    pub conn: ConnId,
    /// Its payload.
    pub payload: Bytes,
}

/// Appends the frames carrying one complete ttrpc `message` on `conn` to `dst` (see [`FIRST_FRAME_MAX`]).
pub fn encode(conn: ConnId, message: &[u8], dst: &mut BytesMut) {
    let (first, mut rest) = message.split_at(message.len().min(FIRST_FRAME_MAX));
    put_frame(conn, first, dst);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_PAYLOAD));
        put_frame(conn, chunk, dst);
        rest = tail;
    }
}

fn put_frame(conn: ConnId, payload: &[u8], dst: &mut BytesMut) {
    let len = u32::try_from(payload.len()).expect("payload is at most MAX_PAYLOAD");
    dst.reserve(HEADER_LEN + payload.len());
    dst.put_u32(conn);
    dst.put_u32(len);
    dst.put_slice(payload);
}

/// Takes one complete frame off the front of `src`, or returns `None` when `src` holds only part of one.
///
/// The announced length is checked against [`MAX_PAYLOAD`] before `src` grows to hold the frame.
pub fn decode(src: &mut BytesMut) -> Result<Option<Frame>, Error> {
    let Some(header) = src.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let conn = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    let len = u32::from_be_bytes([header[4], header[5], header[6], header[7]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(Error::FrameTooLarge { len, max: MAX_PAYLOAD });
    }
    if src.len() < HEADER_LEN + len {
        src.reserve(HEADER_LEN + len - src.len());
        return Ok(None);
    }
    src.advance(HEADER_LEN);
    let payload = src.split_to(len).freeze();
    Ok(Some(Frame { conn, payload }))
}

/// Reads frames from the socket's read half.
#[derive(Debug)]
pub struct FrameReader<R> {
    io: R,
    buf: BytesMut,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Wraps the read half of the socket.
    pub fn new(io: R) -> Self {
        FrameReader { io, buf: BytesMut::with_capacity(8 * 1024) }
    }

    /// The next frame; `None` when the socket ended cleanly between frames. Cancel-safe: bytes read before a
    /// cancellation stay buffered for the next call.
    pub async fn next(&mut self) -> Result<Option<Frame>, Error> {
        loop {
            if let Some(frame) = decode(&mut self.buf)? {
                return Ok(Some(frame));
            }
            if self.io.read_buf(&mut self.buf).await? == 0 {
                return if self.buf.is_empty() { Ok(None) } else { Err(Error::Truncated) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn header_is_conn_id_then_length_big_endian() {
        let mut out = BytesMut::new();
        encode(2, b"abc", &mut out);
        assert_eq!(&out[..], &[0, 0, 0, 2, 0, 0, 0, 3, b'a', b'b', b'c']);
    }

    #[test]
    fn long_message_is_a_short_first_frame_then_the_rest() {
        let message = vec![7u8; FIRST_FRAME_MAX + 5000];
        let mut out = BytesMut::new();
        encode(1, &message, &mut out);
        let first = decode(&mut out).unwrap().unwrap();
        let second = decode(&mut out).unwrap().unwrap();
        assert_eq!((first.payload.len(), second.payload.len()), (FIRST_FRAME_MAX, 5000));
        assert!(out.is_empty());
    }

    #[test]
    fn oversized_frame_is_refused_before_allocating() {
        let mut src = BytesMut::from(&[0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff][..]);
        let err = decode(&mut src).unwrap_err();
        assert_eq!(err.label(), "frame_too_large");
        assert!(src.capacity() < 1024, "capacity grew to {}", src.capacity());
    }

    #[tokio::test]
    async fn reader_reports_eof_between_frames_and_truncation_inside_one() {
        let mut clean = FrameReader::new(&[0u8, 0, 0, 1, 0, 0, 0, 1, 9][..]);
        assert_eq!(clean.next().await.unwrap().unwrap().payload, Bytes::from_static(&[9]));
        assert!(clean.next().await.unwrap().is_none());
        let mut cut = FrameReader::new(&[0u8, 0, 0, 1, 0, 0, 0, 2, 9][..]);
        assert_eq!(cut.next().await.unwrap_err().label(), "truncated");
    }

    proptest! {
        #[test]
        fn frames_round_trip_whatever_the_read_boundaries(
            messages in proptest::collection::vec((1u32..4, proptest::collection::vec(any::<u8>(), 0..9000)), 1..4),
            cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
        ) {
            let mut wire = BytesMut::new();
            for (conn, message) in &messages {
                encode(*conn, message, &mut wire);
            }
            let wire = wire.freeze();
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(wire.len() + 1)).collect();
            cuts.push(wire.len());
            cuts.sort_unstable();
            // Feed the bytes in the chunks the cuts make; reassemble each connection's stream.
            let (mut src, mut start) = (BytesMut::new(), 0);
            let mut streams = std::collections::BTreeMap::<u32, Vec<u8>>::new();
            for cut in cuts {
                src.extend_from_slice(&wire[start..cut]);
                start = cut;
                while let Some(frame) = decode(&mut src).unwrap() {
                    streams.entry(frame.conn).or_default().extend_from_slice(&frame.payload);
                }
            }
            prop_assert!(src.is_empty());
            let mut expected = std::collections::BTreeMap::<u32, Vec<u8>>::new();
            for (conn, message) in &messages {
                expected.entry(*conn).or_default().extend_from_slice(message);
            }
            prop_assert_eq!(streams, expected);
        }
    }

    #[test]
    fn a_frame_split_at_every_byte_boundary_decodes_once() {
        let mut wire = BytesMut::new();
        encode(1, b"hello, runtime", &mut wire);
        for cut in 0..=wire.len() {
            let mut src = BytesMut::from(&wire[..cut]);
            let early = decode(&mut src).unwrap();
            assert_eq!(early.is_some(), cut == wire.len(), "cut at {cut}");
            if early.is_none() {
                src.extend_from_slice(&wire[cut..]);
                let frame = decode(&mut src).unwrap().unwrap();
                assert_eq!(&frame.payload[..], b"hello, runtime");
            }
        }
    }
}
