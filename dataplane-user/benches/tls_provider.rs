//! Which rustls crypto provider HBONE should use: aws-lc-rs or ring.
//!
//! Both run the crate's own HBONE configurations (`tls::server_config_with`,
//! `tls::client_config_with`: TLS 1.3, mutual authentication, SPIFFE
//! verification) with ECDSA P-256 certificates from the built-in CA, over an
//! in-memory transport so that only TLS work is measured:
//!
//! - `handshake/<provider>`: one full mutual handshake (X25519 key exchange,
//!   two ECDSA signatures, four verifications, certificate parsing) from new
//!   connections to both sides done. Handshakes per second = 1 / time.
//! - `bulk/<suite>/<provider>`: one 16 KiB record (the TLS maximum) written
//!   by the client, encrypted, handed over and decrypted by the server.
//!   Criterion prints the throughput.
//!
//! Run with `cargo bench -p dataplane-user --bench tls_provider`.

use std::hint::black_box;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dataplane_user::identity::{Ca, CertSource, CertStore, Identity, TrustBundle};
use dataplane_user::tls;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::ServerName;
use rustls::{CipherSuite, ClientConfig, ClientConnection, ServerConfig, ServerConnection};

const RECORD: usize = 16 * 1024;
const TRUST_DOMAIN: &str = "cluster.local";

/// Client and server configurations for one provider (and, for the client,
/// optionally one cipher suite only).
struct Pair {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

fn configs(base: CryptoProvider, only_suite: Option<CipherSuite>) -> Pair {
    let provider = Arc::new(tls::restrict_to_hbone(base));
    let mut client_provider = CryptoProvider::clone(&provider);
    if let Some(suite) = only_suite {
        client_provider
            .cipher_suites
            .retain(|cs| cs.suite() == suite);
    }
    let ca = Arc::new(Ca::generate().expect("generate CA"));
    let roots = Arc::new(TrustBundle::new(vec![ca.root_der().clone()]).expect("root bundle"));
    let store = Arc::new(CertStore::new(
        CertSource::Builtin(ca),
        roots.clone(),
        provider.clone(),
        Duration::from_secs(3600),
    ));
    let server_id = Identity::new(TRUST_DOMAIN, "bench", "server").expect("identity");
    let client_id = Identity::new(TRUST_DOMAIN, "bench", "client").expect("identity");
    let server = tls::server_config_with(
        provider,
        store.resolver(server_id.clone()),
        roots.clone(),
        TRUST_DOMAIN,
    )
    .expect("server config");
    let client = tls::client_config_with(
        Arc::new(client_provider),
        store.resolver(client_id),
        roots,
        vec![server_id],
    )
    .expect("client config");
    Pair { client, server }
}

fn connect(pair: &Pair) -> (ClientConnection, ServerConnection) {
    let name = ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    let client = ClientConnection::new(pair.client.clone(), name).expect("client connection");
    let server = ServerConnection::new(pair.server.clone()).expect("server connection");
    (client, server)
}

/// Moves TLS bytes both ways until neither side has anything to send.
fn pump(client: &mut ClientConnection, server: &mut ServerConnection, wire: &mut Vec<u8>) {
    loop {
        let mut moved = false;
        while client.wants_write() {
            wire.clear();
            client.write_tls(wire).expect("client write_tls");
            let mut rd = &wire[..];
            while !rd.is_empty() {
                server.read_tls(&mut rd).expect("server read_tls");
                server.process_new_packets().expect("server process");
            }
            moved = true;
        }
        while server.wants_write() {
            wire.clear();
            server.write_tls(wire).expect("server write_tls");
            let mut rd = &wire[..];
            while !rd.is_empty() {
                client.read_tls(&mut rd).expect("client read_tls");
                client.process_new_packets().expect("client process");
            }
            moved = true;
        }
        if !moved {
            break;
        }
    }
}

/// A provider's name and its constructor.
type NamedProvider = (&'static str, fn() -> CryptoProvider);

fn providers() -> [NamedProvider; 2] {
    [
        ("aws-lc-rs", rustls::crypto::aws_lc_rs::default_provider),
        ("ring", rustls::crypto::ring::default_provider),
    ]
}

fn handshake(c: &mut Criterion) {
    let mut group = c.benchmark_group("handshake");
    group.throughput(Throughput::Elements(1));
    for (name, base) in providers() {
        let pair = configs(base(), None);
        let mut wire = Vec::with_capacity(RECORD * 2);
        group.bench_function(name, |b| {
            b.iter(|| {
                let (mut client, mut server) = connect(&pair);
                pump(&mut client, &mut server, &mut wire);
                assert!(!client.is_handshaking() && !server.is_handshaking());
                black_box((client, server))
            });
        });
    }
    group.finish();
}

fn bulk(c: &mut Criterion) {
    let suites = [
        ("aes128gcm", CipherSuite::TLS13_AES_128_GCM_SHA256),
        ("aes256gcm", CipherSuite::TLS13_AES_256_GCM_SHA384),
    ];
    for (suite_name, suite) in suites {
        let mut group = c.benchmark_group(format!("bulk/{suite_name}"));
        group.throughput(Throughput::Bytes(RECORD as u64));
        for (name, base) in providers() {
            let pair = configs(base(), Some(suite));
            let (mut client, mut server) = connect(&pair);
            let mut wire = Vec::with_capacity(RECORD * 2);
            pump(&mut client, &mut server, &mut wire);
            assert_eq!(
                client.negotiated_cipher_suite().map(|cs| cs.suite()),
                Some(suite)
            );
            let payload = vec![0x5a_u8; RECORD];
            let mut sink = vec![0_u8; RECORD];
            group.bench_function(name, |b| {
                b.iter(|| {
                    client
                        .writer()
                        .write_all(&payload)
                        .expect("write plaintext");
                    pump(&mut client, &mut server, &mut wire);
                    server
                        .reader()
                        .read_exact(&mut sink)
                        .expect("read plaintext");
                    black_box(&sink);
                });
            });
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5));
    targets = handshake, bulk
}
criterion_main!(benches);
