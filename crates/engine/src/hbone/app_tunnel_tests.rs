//! The PROXY v2 header checked byte by byte against the format
//! (haproxy `doc/proxy-protocol.txt`, section 2.2), and where each kind
//! of application tunnel delivers a stream.

#![expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]

use super::*;

/// Section 2.2: the 12-byte signature.
const SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

#[test]
fn an_ipv4_header_names_client_destination_and_identity() {
    let id = Identity::new("cluster.local", "shop", "front").unwrap();
    let header = proxy_header(addr("10.1.0.5:40000"), addr("10.96.0.10:80"), Some(&id)).unwrap();
    let uri = b"spiffe://cluster.local/ns/shop/sa/front";
    let mut expected = SIGNATURE.to_vec();
    // Version 2, command PROXY; AF_INET, STREAM.
    expected.extend([0x21, 0x11]);
    // Length: 12 address bytes, then the TLV (type, 16-bit length, value).
    let length = 12 + 3 + uri.len();
    expected.extend(u16::try_from(length).unwrap().to_be_bytes());
    expected.extend([10, 1, 0, 5, 10, 96, 0, 10]);
    expected.extend(40000u16.to_be_bytes());
    expected.extend(80u16.to_be_bytes());
    expected.push(PEER_IDENTITY_TLV);
    expected.extend(u16::try_from(uri.len()).unwrap().to_be_bytes());
    expected.extend(uri);
    assert_eq!(header, expected);
}

#[test]
fn an_ipv6_header_without_identity_has_no_tlv() {
    let header = proxy_header(addr("[fd00::5]:40000"), addr("[fd00::9]:9000"), None).unwrap();
    let mut expected = SIGNATURE.to_vec();
    // AF_INET6, STREAM; 36 address bytes.
    expected.extend([0x21, 0x21, 0, 36]);
    let octets = |ip: &str| ip.parse::<Ipv6Addr>().unwrap().octets();
    expected.extend(octets("fd00::5"));
    expected.extend(octets("fd00::9"));
    expected.extend(40000u16.to_be_bytes());
    expected.extend(9000u16.to_be_bytes());
    assert_eq!(header, expected);
}

#[test]
fn a_mixed_family_pair_is_sent_as_unspecified_as_ztunnel_sends_it() {
    // `ppp`'s `From<(SocketAddr, SocketAddr)>`: AF_UNSPEC, no addresses.
    let header = proxy_header(addr("10.1.0.5:40000"), addr("[fd00::9]:9000"), None).unwrap();
    let mut expected = SIGNATURE.to_vec();
    expected.extend([0x21, 0x01, 0, 0]);
    assert_eq!(header, expected);
}

#[test]
fn each_kind_of_tunnel_delivers_where_ztunnel_does() {
    let app = addr("10.1.0.9:8080");
    let asked = Some(addr("10.96.0.10:80"));
    // No tunnel: the app as asked, from the client.
    assert_eq!(
        Delivery::new(app, asked, None, true),
        Delivery {
            app,
            connect: app,
            from: None,
            proxy_destination: None
        }
    );
    // NONE with a port: only the port changes.
    let none = ApplicationTunnel {
        protocol: AppTunnelProtocol::None,
        port: Some(15088),
    };
    let moved = addr("10.1.0.9:15088");
    assert_eq!(
        Delivery::new(app, asked, Some(none), true),
        Delivery {
            app: moved,
            connect: moved,
            from: None,
            proxy_destination: None
        }
    );
    // PROXY: over loopback to the tunnel's port, naming what was asked.
    let proxy = ApplicationTunnel {
        protocol: AppTunnelProtocol::Proxy,
        port: Some(15088),
    };
    assert_eq!(
        Delivery::new(app, asked, Some(proxy), true),
        Delivery {
            app: moved,
            connect: addr("127.0.0.1:15088"),
            from: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            proxy_destination: asked
        }
    );
    // PROXY without a port, over IPv6: the asked port, on ::1.
    let app6 = addr("[fd00::9]:8080");
    let unset = ApplicationTunnel {
        protocol: AppTunnelProtocol::Proxy,
        port: None,
    };
    assert_eq!(
        Delivery::new(app6, None, Some(unset), true),
        Delivery {
            app: app6,
            connect: addr("[::1]:8080"),
            from: Some(IpAddr::V6(Ipv6Addr::LOCALHOST)),
            proxy_destination: Some(app6)
        }
    );
    // PROXY with `LOCALHOST_APP_TUNNEL=false`: at the pod's address and
    // the tunnel's port, from the client (ztunnel `serve_connect`'s other
    // branch), still behind the header.
    assert_eq!(
        Delivery::new(app, asked, Some(proxy), false),
        Delivery {
            app: moved,
            connect: moved,
            from: None,
            proxy_destination: asked
        }
    );
}
