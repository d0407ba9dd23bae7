//! HBONE TLS over real loopback TCP sockets (tokio + tokio-rustls): who is
//! let in, who is refused and why, and certificate rotation under live
//! connections.

#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::verify::ServerIdentityVerifier;
use super::*;
use crate::identity::{Identity, TrustBundle};

mod crypto_policy;
mod peers;
mod revocation;
mod rotation;

const TD: &str = "cluster.local";

/// One CA and the certificates it issues (the shared test CA).
type Mesh = crate::test_util::TestCa;

fn mesh(validity: Duration) -> Mesh {
    Mesh::with_validity(validity)
}

fn id(td: &str, sa: &str) -> Identity {
    Identity::new(td, "ns1", sa).unwrap()
}

fn server_cfg(mesh: &Mesh, server: &Identity) -> Arc<ServerConfig> {
    server_config(mesh.store.resolver(server.clone()), mesh.roots.clone(), TD).unwrap()
}

fn client_cfg(mesh: &Mesh, client: &Identity, expected: &Identity) -> Arc<ClientConfig> {
    client_config(
        mesh.store.resolver(client.clone()),
        mesh.roots.clone(),
        vec![expected.clone()],
    )
    .unwrap()
}

/// What the server saw of one accepted connection.
#[derive(Debug)]
struct Accepted {
    peer: Option<Identity>,
    alpn: Option<Vec<u8>>,
}

/// Accepts `count` connections; on each, answers every "ping" with "pong"
/// until the client closes. Returns each handshake's outcome in order.
async fn serve(
    config: Arc<ServerConfig>,
    count: usize,
) -> (SocketAddr, JoinHandle<Vec<io::Result<Accepted>>>) {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = TlsAcceptor::from(config);
    let task = tokio::spawn(async move {
        let mut outcomes = Vec::new();
        for _ in 0..count {
            let (tcp, _) = listener.accept().await.unwrap();
            match acceptor.accept(tcp).await {
                Ok(mut tls) => {
                    let (_, conn) = tls.get_ref();
                    outcomes.push(Ok(Accepted {
                        peer: peer_identity(conn),
                        alpn: conn.alpn_protocol().map(<[u8]>::to_vec),
                    }));
                    tokio::spawn(async move {
                        let mut buf = [0_u8; 4];
                        while tls.read_exact(&mut buf).await.is_ok() {
                            if tls.write_all(b"pong").await.is_err() {
                                break;
                            }
                        }
                    });
                }
                Err(e) => outcomes.push(Err(e)),
            }
        }
        outcomes
    });
    (addr, task)
}

type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;

async fn connect(config: Arc<ClientConfig>, addr: SocketAddr) -> io::Result<ClientStream> {
    let tcp = TcpStream::connect(addr).await?;
    TlsConnector::from(config)
        .connect(ServerName::IpAddress(addr.ip().into()), tcp)
        .await
}

async fn ping(tls: &mut ClientStream) -> io::Result<()> {
    tls.write_all(b"ping").await?;
    let mut buf = [0_u8; 4];
    tls.read_exact(&mut buf).await?;
    assert_eq!(&buf, b"pong");
    Ok(())
}

/// The client's view when the *server* refuses it: TLS 1.3 clients finish
/// their side of the handshake before the server checks their certificate,
/// so the refusal shows up as the first read failing.
async fn connect_and_ping(config: Arc<ClientConfig>, addr: SocketAddr) -> io::Result<()> {
    let mut tls = connect(config, addr).await?;
    ping(&mut tls).await
}

fn server_error(outcome: Vec<io::Result<Accepted>>) -> String {
    match outcome.into_iter().next().unwrap() {
        Ok(accepted) => panic!("server accepted {accepted:?}"),
        Err(e) => e.to_string(),
    }
}

fn serial_of(tls: &ClientStream) -> Vec<u8> {
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    let (_, cert) = <x509_parser::certificate::X509Certificate as x509_parser::prelude::FromDer<
        _,
    >>::from_der(&leaf)
    .unwrap();
    cert.raw_serial().to_vec()
}
