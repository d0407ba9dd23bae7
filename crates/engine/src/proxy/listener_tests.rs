//! The three in-pod listener paths on real sockets and real TLS, in a
//! namespace of the test's own ([`crate::test_util::TestPod`]): inbound
//! plaintext (15006) to the app, outbound (15001) through an HBONE tunnel,
//! and inbound HBONE (15008) with policy. Original destinations come from
//! netfilter (iptables `REDIRECT`, the product's baseline capture): no
//! kernel program of ours is loaded.

#![expect(
    clippy::unwrap_used,
    reason = "a failed set-up or exchange should fail the test loudly"
)]

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use bytes::Bytes;
use dataplane_common::{INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::{
    hbone::{PoolError, PoolKey, stream_io::StreamIo},
    test_util::TestPod,
};

const POD_IP: [u8; 4] = [127, 0, 0, 2];
/// A second workload with the pod's identity, whose HBONE port is the
/// pod's own wildcard 15008 listener: the far end of the pod's tunnels.
const PEER_IP: [u8; 4] = [127, 0, 0, 3];

/// The pod and its peer (both `test/test`, HBONE), and a policy that
/// denies port 8081 everywhere.
const MESH: &str = r"
workloads:
- {uid: pod, name: pod, namespace: test, serviceAccount: test, workloadIps: [127.0.0.2]}
- {uid: peer, name: peer, namespace: test, serviceAccount: test, workloadIps: [127.0.0.3]}
policies:
- {name: no-8081, namespace: test, scope: Global, action: Deny, rules: [[[{destinationPorts: [8081]}]]]}
";

fn addr(ip: [u8; 4], port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::from(ip), port)
}

fn pod() -> TestPod {
    TestPod::builder()
        .identity("test", "test")
        .ips(&[IpAddr::from(POD_IP)])
        .config(MESH)
        .build()
}

/// An app at `addr` inside the pod that echoes every connection; counts
/// the connections it accepted.
fn echo_app(pod: &TestPod, addr: SocketAddr) -> Arc<AtomicUsize> {
    let listener = pod.listen(addr);
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut read, mut write) = stream.into_split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    accepted
}

/// Writes `ping` and reads the echo back.
async fn ping(stream: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin)) {
    stream.write_all(b"ping").await.unwrap();
    let mut echoed = [0; 4];
    stream.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"ping");
}

/// A refused client sees its connection end (reset, or closed) with no
/// byte from the app.
async fn assert_refused(stream: &mut tokio::net::TcpStream) {
    let _ = stream.write_all(b"ping").await;
    let mut buf = [0; 4];
    match stream.read(&mut buf).await {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("a refused connection read {n} bytes"),
    }
}

/// Inbound plaintext: a connection to the pod's app port reaches the app
/// through the 15006 listener (it is registered for policy re-checks
/// while open), and one to a port policy denies is reset before any
/// connection to the app is made.
#[tokio::test]
async fn inbound_plaintext_relays_an_allowed_connection_and_refuses_a_denied_one() {
    let pod = pod();
    let _engine = pod.start();
    let (allowed, denied) = (addr(POD_IP, 8080), addr(POD_IP, 8081));
    let (to_allowed, to_denied) = (echo_app(&pod, allowed), echo_app(&pod, denied));
    pod.redirect(allowed, INBOUND_PLAINTEXT_PORT);
    pod.redirect(denied, INBOUND_PLAINTEXT_PORT);

    let mut client = pod.connect(allowed).await.unwrap();
    ping(&mut client).await;
    assert_eq!(to_allowed.load(Ordering::SeqCst), 1);
    // Registered by the inbound listener, not reached directly.
    assert_eq!(pod.ctx.mesh.live.count(), 1);
    drop(client);

    let mut client = pod.connect(denied).await.unwrap();
    assert_refused(&mut client).await;
    assert_eq!(to_denied.load(Ordering::SeqCst), 0);
}

/// Outbound to an HBONE workload: the 15001 listener reads the original
/// destination, opens a tunnel from the pod's pool (mutual TLS with the
/// pod's certificate, the peer's identity verified) to the peer's 15008,
/// whose server dials the app there.
#[tokio::test]
async fn outbound_tunnels_to_an_hbone_peer_that_dials_the_app() {
    let pod = pod();
    let _engine = pod.start();
    let dst = addr(PEER_IP, 8080);
    let app = echo_app(&pod, dst);
    pod.redirect(dst, OUTBOUND_PORT);

    let mut client = pod.connect(dst).await.unwrap();
    ping(&mut client).await;
    assert_eq!(app.load(Ordering::SeqCst), 1);
    assert_eq!(pod.ctx.pool.dials(), 1, "one HBONE connection dialled");
    assert_eq!(pod.ctx.pool.connections(), 1);
    // The stream was registered by the inbound HBONE server.
    assert_eq!(pod.ctx.mesh.live.count(), 1);
}

/// Inbound HBONE: a CONNECT from a client of the mesh (the pod's own
/// pool, presenting its certificate) to a port policy allows is relayed
/// to the app; one to a port policy denies is refused with a status, and
/// the app is never dialled.
#[tokio::test]
async fn inbound_hbone_serves_an_allowed_connect_and_refuses_a_denied_one() {
    let pod = pod();
    let _engine = pod.start();
    let (allowed, denied) = (addr(PEER_IP, 8080), addr(PEER_IP, 8081));
    let (to_allowed, to_denied) = (echo_app(&pod, allowed), echo_app(&pod, denied));
    let key = PoolKey {
        src_identity: pod.ctx.spiffe.clone(),
        dst_identity: TestPod::identity("test", "test"),
        alt_identities: Arc::from([]),
        dst_addr: TestPod::hbone_addr(IpAddr::from(PEER_IP)),
    };
    let source = addr(POD_IP, 40000);
    let baggage = http::HeaderValue::from_static("");
    let trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let connect = |authority: SocketAddr| {
        let (pool, key, baggage) = (Arc::clone(&pod.ctx.pool), key.clone(), baggage.clone());
        async move {
            pool.connect(
                &key,
                &authority.to_string(),
                (source, None),
                (&baggage, trace),
                &Bytes::new(),
            )
            .await
        }
    };

    let tunnel = connect(allowed).await.unwrap();
    let (send, recv, slot) = tunnel.into_parts();
    let mut io = StreamIo::new(send, recv, slot);
    ping(&mut io).await;
    assert_eq!(to_allowed.load(Ordering::SeqCst), 1);
    assert_eq!(pod.ctx.mesh.live.count(), 1);

    let err = connect(denied).await.unwrap_err();
    assert!(
        matches!(&err, PoolError::Refused { status, .. } if status.as_u16() == 401),
        "{err:?}"
    );
    assert_eq!(to_denied.load(Ordering::SeqCst), 0);
}
