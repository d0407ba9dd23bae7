//! The ADS call's gRPC framing, written and read here rather than by
//! tonic's `Streaming`, so that each response is held in a buffer of its
//! own size and freed with it.
//!
//! tonic's decoder reserves room for a whole message in the stream's one
//! read buffer and splits the message off it: the buffer then keeps the
//! largest message's allocation for as long as the stream lasts, after
//! the response was applied and dropped. istiod sends a proxy's whole
//! first state as one message (istio `pilot/pkg/xds/workload.go`
//! `GenerateDeltas`, about 245 bytes a workload), so that is 24 MB held
//! for good at 100,000 workloads and 247 MB at a million (heaptrack on
//! `dp-scale`: the largest live allocation after the first state). Here a
//! message that lies in one HTTP/2 data frame is a slice of it, and a
//! larger one is gathered into a buffer allocated for exactly its length;
//! either is freed when the [`Response`] is dropped.
//!
//! gRPC's wire format over HTTP/2 (grpc/grpc `doc/PROTOCOL-HTTP2.md`):
//! each message is a compressed flag byte, a 4-byte big-endian length and
//! the message; the call's status is the `grpc-status` trailer, or a
//! header when the server answers with trailers only. No compression is
//! offered (no `grpc-accept-encoding`), so a compressed message is
//! refused, as tonic refuses one it did not accept.

use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HeaderValue, TE};
use http_body_util::{BodyExt as _, StreamBody};
use prost::Message as _;
use tokio_stream::{Stream, StreamExt as _};
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tower::ServiceExt as _;

use super::wire::Response;
use crate::istio_api::discovery::DeltaDiscoveryRequest;

/// The length prefix: a compressed flag and a 4-byte length.
const PREFIX: usize = 5;

/// Why the response stream's framing is broken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    /// A message is flagged compressed; none was offered.
    #[error("a message is flagged compressed (flag {0}), but no compression was offered")]
    Compressed(u8),
    /// A message is longer than the limit.
    #[error("a message of {len} bytes is over the {max}-byte limit")]
    TooLarge {
        /// The message's length prefix.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The stream ended inside a message.
    #[error("the stream ended {missing} bytes short of a whole message")]
    Truncated {
        /// Bytes of the message (or its prefix) that never came.
        missing: usize,
    },
}

/// Cuts the response body's data frames into messages.
#[derive(Debug)]
pub struct Framer {
    max: usize,
    /// The prefix read so far (up to [`PREFIX`] bytes).
    prefix: [u8; PREFIX],
    prefix_len: usize,
    /// The message being gathered across frames and its length.
    body: Option<(BytesMut, usize)>,
}

impl Framer {
    /// A framer refusing messages over `max` bytes.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            prefix: [0; PREFIX],
            prefix_len: 0,
            body: None,
        }
    }

    /// Takes bytes from the front of `chunk` until one message is whole
    /// (returned) or `chunk` is used up (`None`: more is needed). What is
    /// left of `chunk` is the next message's.
    pub fn next(&mut self, chunk: &mut Bytes) -> Result<Option<Bytes>, FramingError> {
        if self.body.is_none() {
            let take = (PREFIX - self.prefix_len).min(chunk.len());
            self.prefix[self.prefix_len..self.prefix_len + take].copy_from_slice(&chunk[..take]);
            self.prefix_len += take;
            chunk.advance(take);
            if self.prefix_len < PREFIX {
                return Ok(None);
            }
            self.prefix_len = 0;
            let [flag, len @ ..] = self.prefix;
            if flag != 0 {
                return Err(FramingError::Compressed(flag));
            }
            let len = u32::from_be_bytes(len) as usize;
            if len > self.max {
                return Err(FramingError::TooLarge { len, max: self.max });
            }
            if chunk.len() >= len {
                // The usual case: the whole message in this frame.
                return Ok(Some(chunk.split_to(len)));
            }
            self.body = Some((BytesMut::with_capacity(len), len));
        }
        let Some((buf, len)) = &mut self.body else {
            return Ok(None);
        };
        let take = (*len - buf.len()).min(chunk.len());
        buf.extend_from_slice(&chunk[..take]);
        chunk.advance(take);
        if buf.len() < *len {
            return Ok(None);
        }
        Ok(self.body.take().map(|(buf, _)| buf.freeze()))
    }

    /// Checks that the stream may end here: not inside a message.
    pub fn finish(&self) -> Result<(), FramingError> {
        let missing = match &self.body {
            Some((buf, len)) => len - buf.len(),
            None if self.prefix_len > 0 => PREFIX - self.prefix_len,
            None => 0,
        };
        match missing {
            0 => Ok(()),
            missing => Err(FramingError::Truncated { missing }),
        }
    }
}

/// One request, length-prefixed.
fn frame(request: &DeltaDiscoveryRequest) -> Result<Bytes, Status> {
    let len = request.encoded_len();
    let prefix = u32::try_from(len)
        .map_err(|_| Status::internal(format!("an xDS request of {len} bytes is too large")))?;
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.put_u8(0);
    buf.put_u32(prefix);
    request
        .encode(&mut buf)
        .map_err(|err| Status::internal(format!("encoding an xDS request failed: {err}")))?;
    Ok(buf.freeze())
}

/// An open ADS call: the requests go out as `requests` yields them, the
/// responses are read with [`Self::message`].
pub struct AdsCall {
    body: tonic::body::Body,
    framer: Framer,
    /// What is left of the last data frame.
    rest: Bytes,
    /// The call is over (trailers read, or a trailers-only answer).
    ended: bool,
}

impl std::fmt::Debug for AdsCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdsCall")
            .field("framer", &self.framer)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl AdsCall {
    /// Opens the call `path` on `channel` with `metadata` as headers;
    /// responses over `max_message` bytes end it.
    pub async fn open(
        channel: Channel,
        path: &'static str,
        metadata: MetadataMap,
        requests: impl Stream<Item = DeltaDiscoveryRequest> + Send + 'static,
        max_message: usize,
    ) -> Result<Self, Status> {
        let frames = requests.map(|request| frame(&request).map(http_body::Frame::data));
        let mut request = http::Request::builder()
            .method(http::Method::POST)
            .version(http::Version::HTTP_2)
            .uri(path)
            .body(tonic::body::Body::new(StreamBody::new(frames)))
            .map_err(|err| Status::internal(format!("building the ADS request failed: {err}")))?;
        let headers = request.headers_mut();
        headers.extend(metadata.into_headers());
        headers.insert(TE, HeaderValue::from_static("trailers"));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        let response = channel
            .oneshot(request)
            .await
            .map_err(|err| Status::from_error(Box::new(err)))?;
        // A trailers-only answer carries the status in its headers.
        let ended = match Status::from_header_map(response.headers()) {
            Some(status) if status.code() != Code::Ok => return Err(status),
            Some(_) => true,
            None => false,
        };
        if response.status() != http::StatusCode::OK {
            return Err(Status::unknown(format!(
                "the ADS call was answered with HTTP status {}",
                response.status()
            )));
        }
        Ok(Self {
            body: response.into_body(),
            framer: Framer::new(max_message),
            rest: Bytes::new(),
            ended,
        })
    }

    /// The next response; `None` once the server ended the call cleanly.
    /// Cancel-safe: a partly read message stays in `self`.
    pub async fn message(&mut self) -> Result<Option<Response>, Status> {
        loop {
            if let Some(message) = self.framer.next(&mut self.rest).map_err(malformed)? {
                return Response::decode(message).map(Some).map_err(|err| {
                    Status::internal(format!("istiod's xDS response is malformed: {err}"))
                });
            }
            if self.ended {
                return Ok(None);
            }
            let Some(frame) = self.body.frame().await else {
                // Ended without trailers: a clean end only between messages.
                self.ended = true;
                self.framer.finish().map_err(malformed)?;
                return Ok(None);
            };
            let frame = frame?;
            match frame.into_data() {
                Ok(data) => self.rest = data,
                Err(frame) => {
                    self.ended = true;
                    let Some(trailers) = frame.trailers_ref() else {
                        continue;
                    };
                    match Status::from_header_map(trailers) {
                        Some(status) if status.code() == Code::Ok => {
                            self.framer.finish().map_err(malformed)?;
                        }
                        Some(status) => return Err(status),
                        None => {
                            return Err(Status::unknown(
                                "the ADS call's trailers carry no grpc-status",
                            ));
                        }
                    }
                }
            }
        }
    }
}

fn malformed(err: FramingError) -> Status {
    Status::internal(format!("istiod's xDS response stream is malformed: {err}"))
}

#[cfg(test)]
#[path = "grpc_tests.rs"]
mod tests;
