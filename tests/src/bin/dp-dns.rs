//! `dp-dns MODE SERVER NAME TYPE [EDNS_PAYLOAD]`: one DNS query from inside
//! a pod, the way stub resolvers send it, and what came back.
//!
//! MODE is `udp` (unconnected socket, `sendto`/`recvfrom`: the `sendmsg`
//! and `recvmsg` hooks), `udp-connected` (`connect` then `send`, as glibc
//! does: the `connect` and `recvmsg` hooks) or `tcp`. TYPE is `A`, `AAAA`
//! or `TXT`; EDNS_PAYLOAD adds an OPT record advertising that UDP size.
//!
//! Prints `rcode=<code> tc=<0|1> from=<addr> peer=<addr|-> bytes=<n>`, then
//! one line per answer record (`A 10.96.0.10`, `CNAME name.`, ...). Waits 5
//! seconds for the answer, as `dig` and glibc do, and exits 2 without one.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    str::FromStr as _,
    time::Duration,
};

use anyhow::{Context as _, bail};
use hickory_proto::{
    op::{Edns, Message, MessageType, OpCode, Query},
    rr::{Name, RData, RecordType},
};

const WAIT: Duration = Duration::from_secs(5);

fn main() {
    match run() {
        Ok(()) => {}
        Err(err) => {
            eprintln!("dp-dns: {err:#}");
            std::process::exit(2);
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [mode, server, name, qtype, rest @ ..] = args.as_slice() else {
        bail!("usage: dp-dns udp|udp-connected|tcp SERVER NAME A|AAAA|TXT [EDNS_PAYLOAD]");
    };
    let server: SocketAddr = server.parse().context("SERVER")?;
    let qtype = RecordType::from_str(qtype).context("TYPE")?;
    let mut query = Message::new(0x5eed, MessageType::Query, OpCode::Query);
    query.metadata.recursion_desired = true;
    query
        .queries
        .push(Query::query(Name::from_ascii(name).context("NAME")?, qtype));
    if let Some(payload) = rest.first() {
        let mut edns = Edns::new();
        edns.set_max_payload(payload.parse().context("EDNS_PAYLOAD")?);
        query.edns = Some(edns);
    }
    let raw = query.to_vec()?;
    let bind: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let mut buf = vec![0u8; 65_535];
    let (reply, from, peer) = match mode.as_str() {
        "udp" => {
            let socket = UdpSocket::bind(bind)?;
            socket.set_read_timeout(Some(WAIT))?;
            socket.send_to(&raw, server)?;
            let (n, from) = socket.recv_from(&mut buf).context("no UDP answer")?;
            (buf[..n].to_vec(), from.to_string(), "-".to_owned())
        }
        "udp-connected" => {
            let socket = UdpSocket::bind(bind)?;
            socket.set_read_timeout(Some(WAIT))?;
            socket.connect(server)?;
            socket.send(&raw)?;
            let (n, from) = socket.recv_from(&mut buf).context("no UDP answer")?;
            let peer = socket.peer_addr()?.to_string();
            (buf[..n].to_vec(), from.to_string(), peer)
        }
        "tcp" => {
            let mut stream = TcpStream::connect_timeout(&server, WAIT)?;
            stream.set_read_timeout(Some(WAIT))?;
            let len = u16::try_from(raw.len())?;
            stream.write_all(&len.to_be_bytes())?;
            stream.write_all(&raw)?;
            let mut len = [0u8; 2];
            stream.read_exact(&mut len).context("no TCP answer")?;
            let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
            stream.read_exact(&mut reply)?;
            let peer = stream.peer_addr()?.to_string();
            (reply, peer.clone(), peer)
        }
        other => bail!("unknown mode {other}"),
    };
    let message = Message::from_vec(&reply).context("unparseable answer")?;
    println!(
        "rcode={} tc={} from={from} peer={peer} bytes={}",
        message.metadata.response_code,
        u8::from(message.metadata.truncation),
        reply.len()
    );
    for record in &message.answers {
        match &record.data {
            RData::A(a) => println!("A {}", a.0),
            RData::AAAA(a) => println!("AAAA {}", a.0),
            RData::CNAME(c) => println!("CNAME {}", c.0),
            other => println!("{} {}", other.record_type(), record.name),
        }
    }
    Ok(())
}
