//! Peers that break the protocol, connections beyond the cap, and the
//! socket file the server replaces.

use super::*;

/// `message` padded to 2,000 bytes with unknown fields (number 15, value
/// 0: two bytes each), so its first 1,024 bytes still decode as `message`:
/// only the truncation itself gives it away.
fn oversized(message: &[u8]) -> Vec<u8> {
    let mut bytes = message.to_vec();
    assert!(
        bytes.len().is_multiple_of(2),
        "padding in pairs needs an even start"
    );
    while bytes.len() < 2000 {
        bytes.extend_from_slice(&[0x78, 0x00]);
    }
    bytes
}

/// One way a peer breaks the protocol, played on a fresh connection.
type Misbehaviour = fn(&mut ZdsClient, &std::os::fd::OwnedFd) -> anyhow::Result<()>;

#[test]
fn zds_misbehaving_peers_are_dropped_and_others_keep_being_served() -> anyhow::Result<()> {
    let (_ns_a, pod_a) = pod("a")?;
    let server = Server::start(|c| c.io_timeout = Duration::from_secs(1), vec![pod_a])?;
    let mut good = server.connect()?;
    assert_eq!(good.ack_snapshot()?.len(), 1);

    let hello = ZdsHello { version: 1 }.encode_to_vec();
    let cases: [(&str, bool, Misbehaviour); 9] = [
        ("says nothing", false, |_, _| Ok(())),
        ("sends garbage", false, |c, _| c.send_raw(&[0xff; 16])),
        ("sends an oversized hello", false, |c, _| {
            c.send_raw(&oversized(&ZdsHello { version: 1 }.encode_to_vec()))
        }),
        ("announces version 2", false, |c, _| {
            c.send_raw(&ZdsHello { version: 2 }.encode_to_vec())
        }),
        ("announces no version", false, |c, _| c.send_raw(&[])),
        ("sends a descriptor", false, |c, fd| {
            c.send_with_fd(&ZdsHello { version: 1 }.encode_to_vec(), fd)
        }),
        ("answers the Add with garbage", true, |c, _| {
            c.expect()?;
            c.send_raw(&[0xff; 16])
        }),
        ("answers the Add with 2000 bytes", true, |c, _| {
            c.expect()?;
            c.send_raw(&oversized(&ack_bytes("")))
        }),
        ("speaks unasked after the snapshot", true, |c, _| {
            c.ack_snapshot()?;
            c.send_raw(&ack_bytes(""))
        }),
    ];
    let some_fd: std::os::fd::OwnedFd = std::fs::File::open("/dev/null")?.into();
    for (what, says_hello, misbehave) in cases {
        let mut peer = ZdsClient::connect_silent(&server.socket)?;
        if says_hello {
            peer.send_raw(&hello)?;
        }
        misbehave(&mut peer, &some_fd).with_context(|| what.to_owned())?;
        peer.expect_closed()
            .with_context(|| format!("a peer that {what} was not dropped"))?;
    }

    // The well-behaved one is still served.
    let status = server.handle.status();
    assert_eq!(status.connections.len(), 1, "{status:?}");
    let (ns_b, pod_b) = pod("b")?;
    let caller = server.add_in_background(pod_b);
    check_add(&good.expect()?, "b", &ns_b)?;
    good.ack()?;
    assert!(matches!(join(caller)??, AddOutcome::Acked { .. }));
    Ok(())
}

#[test]
fn zds_connections_beyond_the_cap_are_refused() -> anyhow::Result<()> {
    let server = Server::start(|c| c.max_connections = 2, vec![])?;
    let mut first = server.connect()?;
    first.ack_snapshot()?;
    let mut second = server.connect()?;
    second.ack_snapshot()?;
    // Refused at accept, before its hello could be read.
    let mut third = ZdsClient::connect_silent(&server.socket)?;
    third.expect_closed()?;
    drop(first);
    assert!(matches!(server.event()?, Event::Disconnected(_)));
    let mut fourth = server.connect()?;
    fourth.ack_snapshot()?;
    assert_eq!(server.handle.status().connections.len(), 2);
    Ok(())
}

#[test]
fn zds_a_stale_socket_file_is_replaced_and_other_files_are_not() -> anyhow::Result<()> {
    let dir = TempDir::new("zds")?;
    let socket = dir.path().join("ztunnel.sock");
    // A socket file left by a previous agent: bound, then its process gone.
    drop(std::os::unix::net::UnixListener::bind(&socket)?);
    assert!(socket.exists());
    let config = ZdsConfig {
        socket: socket.clone(),
        ..ZdsConfig::default()
    };
    let server = Server::start_at(dir, config.clone(), vec![])?;
    server.connect()?.ack_snapshot()?;
    drop(server);
    assert!(!socket.exists(), "the socket file outlived the server");

    let dir = TempDir::new("zds")?;
    let not_socket = dir.path().join("ztunnel.sock");
    std::fs::write(&not_socket, "keep me")?;
    let config = ZdsConfig {
        socket: not_socket.clone(),
        ..config
    };
    match Server::start_at(dir, config, vec![]) {
        Err(e) => assert!(
            matches!(
                e.downcast_ref::<ZdsError>(),
                Some(ZdsError::NotASocket { .. })
            ),
            "{e:#}"
        ),
        Ok(_) => anyhow::bail!("the server replaced a regular file"),
    }
    Ok(())
}
