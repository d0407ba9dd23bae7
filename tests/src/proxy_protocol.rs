//! A strict reader of PROXY protocol v2 headers (haproxy
//! `doc/proxy-protocol.txt`, section 2.2), for test servers that stand in
//! for an app behind an application tunnel (a sandwiched waypoint). It
//! accepts only what the node proxy should send (command PROXY, TCP over
//! IPv4 or IPv6, well-formed TLVs) and refuses anything else, so a sloppy
//! header fails the test. Written apart from the agent's encoder, from the
//! format's text.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

/// The 12-byte signature every v2 header starts with.
pub const SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

/// The longest header accepted: the node proxy sends addresses and one
/// identity; a longer one is a bug, not something to read.
pub const MAX_HEADER: usize = 1024;

/// The TLV carrying the client's SPIFFE identity (Istio
/// `proto/workload.proto`, `ApplicationTunnel.Protocol.PROXY`).
pub const PEER_IDENTITY_TLV: u8 = 0xD0;

/// One header, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyHeader {
    /// The client.
    pub source: SocketAddr,
    /// The destination the client asked for.
    pub destination: SocketAddr,
    /// Type-length-value records, in order.
    pub tlvs: Vec<(u8, Vec<u8>)>,
}

impl ProxyHeader {
    /// The value of TLV `kind`, as text, if the header has exactly one.
    pub fn tlv_text(&self, kind: u8) -> Option<String> {
        let mut found = self.tlvs.iter().filter(|(k, _)| *k == kind);
        let (_, value) = found.next()?;
        if found.next().is_some() {
            return None;
        }
        String::from_utf8(value.clone()).ok()
    }
}

/// Reads the header at the start of `bytes`; returns it and what follows.
pub fn parse(bytes: &[u8]) -> anyhow::Result<(ProxyHeader, &[u8])> {
    anyhow::ensure!(
        bytes.len() >= 16,
        "{} bytes: shorter than a v2 header's fixed part",
        bytes.len()
    );
    anyhow::ensure!(
        bytes[..12] == SIGNATURE,
        "no v2 signature: {:02x?}",
        &bytes[..16]
    );
    anyhow::ensure!(
        bytes[12] == 0x21,
        "version/command {:#04x}, expected 0x21 (v2, PROXY)",
        bytes[12]
    );
    let length = usize::from(u16::from_be_bytes([bytes[14], bytes[15]]));
    anyhow::ensure!(
        16 + length <= MAX_HEADER,
        "header of {} bytes is over {MAX_HEADER}",
        16 + length
    );
    let body = bytes.get(16..16 + length).ok_or_else(|| {
        anyhow::anyhow!("header says {length} bytes, {} follow", bytes.len() - 16)
    })?;
    let rest = &bytes[16 + length..];
    let (source, destination, tlvs) = match bytes[13] {
        // TCP over IPv4: 4 + 4 address bytes, 2 + 2 port bytes.
        0x11 => {
            anyhow::ensure!(
                body.len() >= 12,
                "IPv4 address block of {} bytes",
                body.len()
            );
            let ip = |at: usize| Ipv4Addr::new(body[at], body[at + 1], body[at + 2], body[at + 3]);
            let port = |at: usize| u16::from_be_bytes([body[at], body[at + 1]]);
            (
                SocketAddr::new(ip(0).into(), port(8)),
                SocketAddr::new(ip(4).into(), port(10)),
                &body[12..],
            )
        }
        // TCP over IPv6: 16 + 16, 2 + 2.
        0x21 => {
            anyhow::ensure!(
                body.len() >= 36,
                "IPv6 address block of {} bytes",
                body.len()
            );
            let ip = |at: usize| {
                let mut octets = [0u8; 16];
                octets.copy_from_slice(&body[at..at + 16]);
                Ipv6Addr::from(octets)
            };
            let port = |at: usize| u16::from_be_bytes([body[at], body[at + 1]]);
            (
                SocketAddr::new(ip(0).into(), port(32)),
                SocketAddr::new(ip(16).into(), port(34)),
                &body[36..],
            )
        }
        other => anyhow::bail!(
            "family/protocol {other:#04x}, expected TCP over IPv4 (0x11) or IPv6 (0x21)"
        ),
    };
    Ok((
        ProxyHeader {
            source,
            destination,
            tlvs: parse_tlvs(tlvs)?,
        },
        rest,
    ))
}

/// TLVs must fill what is left of the header exactly.
fn parse_tlvs(mut bytes: &[u8]) -> anyhow::Result<Vec<(u8, Vec<u8>)>> {
    let mut tlvs = Vec::new();
    while !bytes.is_empty() {
        anyhow::ensure!(
            bytes.len() >= 3,
            "{} stray bytes after the TLVs",
            bytes.len()
        );
        let length = usize::from(u16::from_be_bytes([bytes[1], bytes[2]]));
        let value = bytes.get(3..3 + length).ok_or_else(|| {
            anyhow::anyhow!(
                "TLV {:#04x} says {length} bytes, {} follow",
                bytes[0],
                bytes.len() - 3
            )
        })?;
        tlvs.push((bytes[0], value.to_vec()));
        bytes = &bytes[3 + length..];
    }
    Ok(tlvs)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use super::*;

    fn ipv4_header(tlvs: &[u8]) -> Vec<u8> {
        let mut h = SIGNATURE.to_vec();
        h.extend([0x21, 0x11]);
        h.extend(u16::try_from(12 + tlvs.len()).unwrap().to_be_bytes());
        h.extend([10, 0, 0, 1, 10, 0, 0, 2, 0x9c, 0x40, 0x00, 0x50]);
        h.extend(tlvs);
        h
    }

    #[test]
    fn a_header_is_read_and_the_payload_follows() {
        let mut bytes = ipv4_header(&[0xD0, 0, 3, b'a', b'b', b'c']);
        bytes.extend(b"hello");
        let (header, rest) = parse(&bytes).unwrap();
        assert_eq!(header.source, "10.0.0.1:40000".parse().unwrap());
        assert_eq!(header.destination, "10.0.0.2:80".parse().unwrap());
        assert_eq!(header.tlv_text(PEER_IDENTITY_TLV).as_deref(), Some("abc"));
        assert_eq!(rest, b"hello");
    }

    #[test]
    fn anything_but_a_well_formed_proxy_header_is_refused() {
        let good = ipv4_header(&[]);
        let mut local = good.clone();
        local[12] = 0x20;
        let mut udp = good.clone();
        udp[13] = 0x12;
        let mut long = good.clone();
        long[15] = 40;
        let torn_tlv = ipv4_header(&[0xD0, 0, 9, b'a']);
        let stray = ipv4_header(&[0xD0]);
        let mut huge = good.clone();
        huge[14] = 0xff;
        for (name, bytes) in [
            ("no signature", b"GET / HTTP/1.1\r\n\r\n".to_vec()),
            ("LOCAL", local),
            ("UDP", udp),
            ("length past the end", long),
            ("torn TLV", torn_tlv),
            ("stray byte", stray),
            ("over the bound", huge),
            ("short", good[..10].to_vec()),
        ] {
            assert!(parse(&bytes).is_err(), "{name} was accepted");
        }
    }
}
