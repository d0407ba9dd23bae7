#![expect(
    clippy::unwrap_used,
    reason = "a bad fixture or a broken server should fail the test loudly"
)]

use std::net::SocketAddr;

use prost_types::Any;
use tokio::net::TcpListener;

use super::*;
use crate::istio_api::discovery::{DeltaDiscoveryResponse, Resource};

const PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

fn response(nonce: &str, resources: usize) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: "type.googleapis.com/istio.workload.Address".into(),
        nonce: nonce.into(),
        resources: (0..resources)
            .map(|i| Resource {
                name: format!("Kubernetes//Pod/shop/web-{i}"),
                version: "1".into(),
                resource: Some(Any {
                    type_url: "type.googleapis.com/istio.workload.Address".into(),
                    value: vec![0x0a, 0x01, b'w'],
                }),
                ..Resource::default()
            })
            .collect(),
        ..DeltaDiscoveryResponse::default()
    }
}

/// `message` with its gRPC length prefix.
fn framed(message: &impl prost::Message, flag: u8) -> Vec<u8> {
    let body = message.encode_to_vec();
    let mut out = vec![flag];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

#[test]
fn messages_come_out_whole_wherever_the_frames_split_them() {
    let first = framed(&response("n-1", 3), 0);
    let second = framed(&response("n-2", 1), 0);
    let empty = framed(&DeltaDiscoveryResponse::default(), 0);
    let stream: Vec<u8> = [&first[..], &second[..], &empty[..]].concat();
    let want: Vec<Bytes> = [&first, &second, &empty]
        .iter()
        .map(|f| Bytes::copy_from_slice(&f[PREFIX..]))
        .collect();
    // Every chunk size, from byte by byte to all at once.
    for size in 1..=stream.len() {
        let mut framer = Framer::new(1 << 20);
        let mut got = Vec::new();
        for chunk in stream.chunks(size) {
            let mut chunk = Bytes::copy_from_slice(chunk);
            while let Some(message) = framer.next(&mut chunk).unwrap() {
                got.push(message);
            }
            assert!(chunk.is_empty(), "chunk size {size}: bytes left unread");
        }
        assert_eq!(got, want, "chunk size {size}");
        framer.finish().unwrap();
    }
}

#[test]
fn a_gathered_message_owns_a_buffer_of_its_own_length() {
    // The point of the module: nothing else keeps the message's memory,
    // and nothing beyond it is reserved, so dropping the response frees it.
    let stream = framed(&response("n-1", 50), 0);
    let len = stream.len() - PREFIX;
    let mut framer = Framer::new(1 << 20);
    let (head, tail) = stream.split_at(stream.len() / 2);
    let mut chunk = Bytes::copy_from_slice(head);
    assert_eq!(framer.next(&mut chunk).unwrap(), None);
    let mut chunk = Bytes::copy_from_slice(tail);
    let message = framer.next(&mut chunk).unwrap().unwrap();
    let owned = message
        .try_into_mut()
        .expect("the message shares its buffer with something else");
    assert_eq!((owned.len(), owned.capacity()), (len, len));
}

#[test]
fn a_message_in_one_frame_is_a_slice_of_it() {
    let stream = Bytes::from(framed(&response("n-1", 2), 0));
    let mut chunk = stream.clone();
    let message = Framer::new(1 << 20).next(&mut chunk).unwrap().unwrap();
    assert_eq!(message.as_ptr(), stream[PREFIX..].as_ptr());
}

#[test]
fn bad_prefixes_and_cut_messages_are_refused() {
    let mut chunk = Bytes::from(framed(&response("n-1", 1), 1));
    assert_eq!(
        Framer::new(1 << 20).next(&mut chunk),
        Err(FramingError::Compressed(1))
    );
    let message = framed(&response("n-1", 4), 0);
    let len = message.len() - PREFIX;
    let mut chunk = Bytes::from(message.clone());
    assert_eq!(
        Framer::new(len - 1).next(&mut chunk),
        Err(FramingError::TooLarge { len, max: len - 1 })
    );
    // Cut in the prefix and in the body.
    for (cut, missing) in [(3, 2), (PREFIX + 7, len - 7)] {
        let mut framer = Framer::new(1 << 20);
        let mut chunk = Bytes::copy_from_slice(&message[..cut]);
        assert_eq!(framer.next(&mut chunk), Ok(None));
        assert_eq!(framer.finish(), Err(FramingError::Truncated { missing }));
    }
}

/// How the test server ends the call after its data frames.
enum End {
    /// Trailers with this `grpc-status` (and a message).
    Trailers(u16),
    /// The body ends with its last data frame, no trailers.
    Bare,
    /// A trailers-only answer: the status in the headers, no body.
    HeadersOnly(u16),
    /// Trailers without a `grpc-status`.
    TrailersWithoutStatus,
    /// An HTTP status other than 200, no body.
    HttpStatus(u16),
}

/// What the server saw of the request.
struct Seen {
    headers: http::HeaderMap,
    path: String,
    /// The request body's first message, prefix removed.
    first_request: Vec<u8>,
}

/// A real HTTP/2 server on loopback answering one call with `frames`
/// (each a data frame) and `end`.
async fn serve(frames: Vec<Vec<u8>>, end: End) -> (SocketAddr, tokio::task::JoinHandle<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (socket, _) = listener.accept().await.unwrap();
        let mut conn = h2::server::handshake(socket).await.unwrap();
        let (request, mut respond) = conn.accept().await.unwrap().unwrap();
        // Keep the connection driven while the call is answered (ended
        // with the test's runtime).
        tokio::spawn(async move { while conn.accept().await.is_some() {} });
        let (parts, mut body) = request.into_parts();
        let mut first_request = Vec::new();
        while first_request.len() < PREFIX
            || first_request.len()
                < PREFIX + u32::from_be_bytes(first_request[1..5].try_into().unwrap()) as usize
        {
            let data = body.data().await.unwrap().unwrap();
            body.flow_control().release_capacity(data.len()).unwrap();
            first_request.extend_from_slice(&data);
        }
        let status = match end {
            End::HttpStatus(status) => status,
            _ => 200,
        };
        let mut head = http::Response::builder()
            .status(status)
            .header("content-type", "application/grpc");
        if let End::HttpStatus(_) = end {
            respond.send_response(head.body(()).unwrap(), true).unwrap();
        } else if let End::HeadersOnly(code) = end {
            head = head.header("grpc-status", code.to_string());
            respond.send_response(head.body(()).unwrap(), true).unwrap();
        } else {
            let mut send = respond
                .send_response(head.body(()).unwrap(), false)
                .unwrap();
            let last = frames.len().saturating_sub(1);
            for (i, frame) in frames.into_iter().enumerate() {
                let end_stream = matches!(end, End::Bare) && i == last;
                send.send_data(frame.into(), end_stream).unwrap();
            }
            if let End::Trailers(_) | End::TrailersWithoutStatus = end {
                let mut trailers = http::HeaderMap::new();
                if let End::Trailers(code) = end {
                    trailers.insert("grpc-status", code.to_string().parse().unwrap());
                }
                trailers.insert("grpc-message", "test%20end".parse().unwrap());
                send.send_trailers(trailers).unwrap();
            }
        }
        Seen {
            headers: parts.headers,
            path: parts.uri.path().to_owned(),
            first_request: first_request[PREFIX..].to_vec(),
        }
    });
    (addr, server)
}

async fn call(addr: SocketAddr) -> Result<AdsCall, Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut metadata = MetadataMap::new();
    metadata.insert("authorization", "Bearer t0ken".parse().unwrap());
    let request = DeltaDiscoveryRequest {
        type_url: "type.googleapis.com/istio.workload.Address".into(),
        ..DeltaDiscoveryRequest::default()
    };
    AdsCall::open(
        channel,
        PATH,
        metadata,
        tokio_stream::iter([request]),
        1 << 20,
    )
    .await
}

#[tokio::test]
async fn a_call_carries_the_request_and_reads_each_response_whole() {
    let first = framed(&response("n-1", 40), 0);
    let second = framed(&response("n-2", 1), 0);
    // Frames that cut the first response, and join its end to the second.
    let stream = [&first[..], &second[..]].concat();
    let frames = vec![
        stream[..3].to_vec(),
        stream[3..100].to_vec(),
        stream[100..].to_vec(),
    ];
    let (addr, server) = serve(frames, End::Trailers(0)).await;
    let mut call = call(addr).await.unwrap();
    let got = call.message().await.unwrap().unwrap();
    assert_eq!((got.nonce(), got.resource_count()), ("n-1", 40));
    let got = call.message().await.unwrap().unwrap();
    assert_eq!((got.nonce(), got.resource_count()), ("n-2", 1));
    assert!(call.message().await.unwrap().is_none());
    drop(call);
    let seen = server.await.unwrap();
    assert_eq!(seen.path, PATH);
    assert_eq!(seen.headers["content-type"], "application/grpc");
    assert_eq!(seen.headers["te"], "trailers");
    assert_eq!(seen.headers["authorization"], "Bearer t0ken");
    assert!(!seen.headers.contains_key("grpc-accept-encoding"));
    let request = DeltaDiscoveryRequest::decode(&seen.first_request[..]).unwrap();
    assert_eq!(
        request.type_url,
        "type.googleapis.com/istio.workload.Address"
    );
}

#[tokio::test]
async fn the_status_in_the_trailers_ends_the_call() {
    let (addr, server) = serve(vec![framed(&response("n-1", 1), 0)], End::Trailers(14)).await;
    let mut call = call(addr).await.unwrap();
    assert!(call.message().await.unwrap().is_some());
    let status = call.message().await.unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::Unavailable, "test end")
    );
    drop(call);
    server.await.unwrap();
}

#[tokio::test]
async fn a_trailers_only_answer_is_its_status() {
    let (addr, server) = serve(Vec::new(), End::HeadersOnly(7)).await;
    let status = call(addr).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    server.await.unwrap();
}

#[tokio::test]
async fn trailers_without_a_status_or_an_http_error_end_the_call_with_an_error() {
    let (addr, server) = serve(
        vec![framed(&response("n-1", 1), 0)],
        End::TrailersWithoutStatus,
    )
    .await;
    let mut ads = call(addr).await.unwrap();
    assert!(ads.message().await.unwrap().is_some());
    let status = ads.message().await.unwrap_err();
    assert_eq!(status.code(), Code::Unknown, "{status}");
    assert!(status.message().contains("no grpc-status"), "{status}");
    drop(ads);
    server.await.unwrap();

    let (addr, server) = serve(Vec::new(), End::HttpStatus(503)).await;
    let status = call(addr).await.unwrap_err();
    assert_eq!(status.code(), Code::Unknown, "{status}");
    assert!(status.message().contains("HTTP status 503"), "{status}");
    server.await.unwrap();
}

#[tokio::test]
async fn a_call_ended_inside_a_message_is_an_error_not_an_end() {
    let message = framed(&response("n-1", 5), 0);
    let cut = message[..message.len() - 4].to_vec();
    for end in [End::Trailers(0), End::Bare] {
        let (addr, server) = serve(vec![cut.clone()], end).await;
        let mut call = call(addr).await.unwrap();
        let status = call.message().await.unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status}");
        assert!(status.message().contains("4 bytes short"), "{status}");
        drop(call);
        server.await.unwrap();
    }
}

#[tokio::test]
async fn a_compressed_or_malformed_response_ends_the_call() {
    for (frame, what) in [
        (framed(&response("n-1", 1), 1), "compressed"),
        (vec![0, 0, 0, 0, 2, 0x12, 0x05], "malformed"),
    ] {
        let (addr, server) = serve(vec![frame], End::Trailers(0)).await;
        let mut call = call(addr).await.unwrap();
        let status = call.message().await.unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{what}: {status}");
        assert!(status.message().contains(what), "{what}: {status}");
        drop(call);
        server.await.unwrap();
    }
}
