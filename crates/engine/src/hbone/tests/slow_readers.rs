//! The tunnel relay under flow control: slow readers on both sides stall
//! their senders through HTTP/2 windows and TCP buffers, and every byte
//! still arrives, in order.

use super::*;

/// Bytes each way: many times the streams' windows and the sockets'
/// buffers, so both directions stall again and again.
const SIZE: usize = 8 * 1024 * 1024;

/// A pause after every this many bytes read.
const PAUSE_EVERY: usize = 256 * 1024;

/// Reads everything from `reader` in small pieces, pausing now and then:
/// a reader slower than its sender.
async fn read_slowly(mut reader: impl AsyncReadExt + Unpin) -> std::io::Result<Vec<u8>> {
    let mut got = Vec::with_capacity(SIZE);
    let mut piece = [0u8; 4096];
    let mut since_pause = 0;
    loop {
        let n = reader.read(&mut piece).await?;
        if n == 0 {
            return Ok(got);
        }
        got.extend_from_slice(&piece[..n]);
        since_pause += n;
        if since_pause >= PAUSE_EVERY {
            since_pause = 0;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

fn pattern(seed: u32) -> Vec<u8> {
    (0..SIZE as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect()
}

#[tokio::test]
async fn slow_readers_on_both_sides_get_every_byte_in_order() -> anyhow::Result<()> {
    let (server, _stop) = hbone_server().await?;
    // The app sends its own bytes while it reads the client's slowly.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let app = listener.local_addr()?;
    let from_app = pattern(7);
    let app_sends = from_app.clone();
    let app_task = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await?;
        let (r, mut w) = stream.split();
        let (request, ()) = tokio::try_join!(read_slowly(r), async {
            w.write_all(&app_sends).await?;
            w.shutdown().await
        })?;
        Ok::<_, std::io::Error>(request)
    });
    let pool = HbonePool::new(TcpDialer, Duration::from_secs(30));
    let tunnel = open(&pool, server, &app.to_string()).await?;
    let (mut client, engine) = tcp_pair().await?;
    let relay_task = tokio::spawn(relay(engine, tunnel.send, tunnel.recv, Default::default()));

    let from_client = pattern(3);
    let (r, mut w) = client.split();
    let (received, ()) = tokio::try_join!(read_slowly(r), async {
        w.write_all(&from_client).await?;
        w.shutdown().await
    })?;
    assert!(received == from_app, "the app's bytes arrived corrupted");
    let request = app_task.await??;
    assert!(
        request == from_client,
        "the client's bytes arrived corrupted"
    );
    let transferred = relay_task.await??;
    assert_eq!(transferred.sent, SIZE as u64);
    assert_eq!(transferred.received, SIZE as u64);
    Ok(())
}
