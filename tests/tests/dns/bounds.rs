//! What a pod sends its resolver is bounded.

use super::*;

#[test]
fn what_a_pod_sends_its_resolver_is_bounded() -> anyhow::Result<()> {
    use std::{
        io::{ErrorKind, Read as _},
        net::{TcpStream, UdpSocket},
        time::Duration,
    };

    use hickory_proto::{
        op::{Message, MessageType, OpCode, Query, ResponseCode},
        rr::{Name, RecordType},
    };

    let upstream = FakeDns::on_loopback(UPSTREAM_TAG)?;
    let w = world("dnsbound", upstream.addr())?;
    let resolver: SocketAddr = "127.0.0.1:15053".parse()?;
    let mut query = Message::new(0x77, MessageType::Query, OpCode::Query);
    query.queries.push(Query::query(
        Name::from_ascii(format!("echo.{NAMESPACE}.svc.cluster.local."))?,
        RecordType::A,
    ));
    let valid = query.to_vec()?;
    // A stranger in the pod talks to the resolver directly.
    let (garbage, valid_after, surplus, idle) =
        w.client.netns.run(move || -> anyhow::Result<_> {
            let udp = UdpSocket::bind("127.0.0.1:0")?;
            udp.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut buf = vec![0u8; 65_535];
            // A header followed by nonsense: FORMERR.
            udp.send_to(
                &[0x12, 0x34, 0x01, 0, 0, 9, 0, 9, 0, 9, 0, 9, 0xff, 0xff],
                resolver,
            )?;
            let n = udp.recv(&mut buf)?;
            let garbage = Message::from_vec(&buf[..n])?.metadata.response_code;
            // Over the size bound: dropped; the next query still answers.
            udp.send_to(&vec![0u8; 5000], resolver)?;
            udp.send_to(&valid, resolver)?;
            let n = udp.recv(&mut buf)?;
            let valid_after = Message::from_vec(&buf[..n])?.metadata.id;
            // TCP: 64 connections are served; the next one is reset.
            let held: Vec<TcpStream> = (0..64)
                .map(|_| TcpStream::connect(resolver))
                .collect::<Result<_, _>>()?;
            let mut extra = TcpStream::connect(resolver)?;
            extra.set_read_timeout(Some(Duration::from_secs(10)))?;
            let surplus = extra.read(&mut buf).map_err(|e| e.kind());
            // An idle connection is reset (after 10 s; 30 s is the liveness
            // bound).
            let mut first = held
                .into_iter()
                .next()
                .ok_or_else(|| anyhow::anyhow!("no connection"))?;
            first.set_read_timeout(Some(Duration::from_secs(30)))?;
            let idle = first.read(&mut buf).map_err(|e| e.kind());
            Ok((garbage, valid_after, surplus, idle))
        })??;
    assert_eq!(garbage, ResponseCode::FormErr);
    assert_eq!(valid_after, 0x77);
    assert_eq!(surplus, Err(ErrorKind::ConnectionReset));
    assert_eq!(idle, Err(ErrorKind::ConnectionReset));
    let samples = scrape(&w.agent)?;
    assert_eq!(
        value(
            &samples,
            "dataplane_dns_answers_total",
            &[("kind", "formerr")]
        ),
        Some(1.0)
    );
    assert!(
        value(
            &samples,
            "dataplane_dns_answers_total",
            &[("kind", "refused")]
        ) >= Some(1.0)
    );
    Ok(())
}
